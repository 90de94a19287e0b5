"""A program's own prefix cache, kept as files in the KV file system.

Each file holds the KV cache of a token sequence a request computed (a conversation so
far: system prompt, turns, the answer). A new request forks the file sharing the longest
common prefix with its prompt and truncates the fork to that prefix, so a repeated
system prompt or conversation is computed once. Policy, all the program's own:
* files live in one directory under the mount (`ls` shows them), named
  `SCOPE-HASH.kv`: SCOPE separates callers (one caller's prompts never warm another's
  cache, which would tell them what others asked); HASH names the tokens;
* a prefix shorter than `min_tokens` is not worth a file or a fork;
* a new sequence that extends a file's replaces that file; one already covered by a
  file only refreshes it;
* at most `max_files` files, least recently used removed first (`rm`: their pages go
  back to predd's pool unless a request still holds a fork); all of them when predd
  has no room for a request's call (openai_lip/room.py).
The token lists are kept in memory and read back from the files at start-up
(`kv_tokens`), so the cache survives a restart of the program (and of the daemons, for
files that were `sync`ed).
"""
from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import liblip as lip


@dataclass
class Entry:
    scope: str
    tokens: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with alike."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def scope_tag(scope: str) -> str:
    return hashlib.sha256(scope.encode()).hexdigest()[:8]


class PrefixCache:
    def __init__(self, folder: str, max_files: int = 16, min_tokens: int = 16) -> None:
        self.folder = folder
        self.max_files = max_files
        self.min_tokens = min_tokens
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.lock = threading.Lock()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self._load()

    def _load(self) -> None:
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if not name.endswith(".kv"):
                continue
            try:
                with lip.kv_open(path) as kv:
                    self.entries[path] = Entry(name.split("-", 1)[0], lip.kv_tokens(kv))
            except lip.LipError:
                continue

    def lookup(self, scope: str, tokens: list[int]) -> tuple[lip.KV, int]:
        """A fresh read-write cache holding the longest cached prefix of `tokens` (at
        most all of them), and that prefix's length (0: an empty cache)."""
        tag = scope_tag(scope)
        with self.lock:
            best, best_len = None, 0
            for path, e in self.entries.items():
                if e.scope == tag:
                    n = common_prefix(e.tokens, tokens)
                    if n > best_len:
                        best, best_len = path, n
            if best is None or best_len < self.min_tokens:
                return lip.kv_create(), 0
            self.entries.move_to_end(best)
            stored = len(self.entries[best].tokens)
        try:
            with lip.kv_open(best) as src:
                kv = lip.kv_fork(src)
        except lip.LipError:           # removed meanwhile (by us or by hand)
            with self.lock:
                self.entries.pop(best, None)
            return lip.kv_create(), 0
        if stored > best_len:
            lip.kv_truncate(kv, best_len)
        return kv, best_len

    def store(self, scope: str, kv: lip.KV, tokens: list[int]) -> str | None:
        """Keep `kv` (holding exactly `tokens`) as a file; returns its path, or None
        when it adds nothing."""
        if len(tokens) < self.min_tokens:
            return None
        tag = scope_tag(scope)
        with self.lock:
            covered = []
            for path, e in self.entries.items():
                if e.scope != tag:
                    continue
                n = common_prefix(e.tokens, tokens)
                if n == len(tokens):                # already have it (or more)
                    self.entries.move_to_end(path)
                    return None
                if n == len(e.tokens):              # the new one extends this file
                    covered.append(path)
            digest = hashlib.sha256(repr(tokens).encode()).hexdigest()[:24]
            path = os.path.join(self.folder, f"{tag}-{digest}.kv")
            lip.kv_save(kv, path)
            self.entries[path] = Entry(tag, list(tokens))
            for old in covered:
                self._remove(old)
            while len(self.entries) > self.max_files:
                self._remove(next(iter(self.entries)))
        return path

    def drop_all(self) -> bool:
        """Remove every file (predd has no room: their pages go back, except those a
        request's fork still holds); False when there was none."""
        with self.lock:
            paths = list(self.entries)
            for path in paths:
                self._remove(path)
        return bool(paths)

    def _remove(self, path: str) -> None:
        self.entries.pop(path, None)
        try:
            os.unlink(path)
        except OSError:
            pass
