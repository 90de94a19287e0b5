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
* the calls to predd and the mount are made outside the cache's lock (predd answers
  between steps: a call under it would let one request through a step); a request
  answers before its file is saved, having promised it (`promise`, `keep`), and a
  lookup that a promised file would serve better waits for it (at most COMING_WAIT_S).
The token lists are kept in memory and read back from the files at start-up
(`kv_tokens`), so the cache survives a restart of the program (and of the daemons, for
files that were `sync`ed).
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import liblip as lip


COMING_WAIT_S = 10.0   # a backstop: a promised file comes when its save ends (calls, not work)


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


class EmptyCaches:
    """Empty caches made ahead of the requests that take them: a request whose prompt has
    no cached prefix begins with its `generate`, not with a `kv_create` that waits for
    predd's step to end (a burst of requests would enter that step one by one). At most
    `keep` wait, holding no page; each one taken is made again by a thread of its own,
    so that the calls of a burst's refill are answered in one turn."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.ready: collections.deque[lip.KV] = collections.deque()
        self.making = 0
        self.lock = threading.Lock()
        self._refill()

    def take(self) -> lip.KV:
        with self.lock:
            kv = self.ready.popleft() if self.ready else None
        self._refill()
        return kv if kv is not None else lip.kv_create()

    def _refill(self) -> None:
        with self.lock:
            missing = self.keep - len(self.ready) - self.making
            self.making += max(missing, 0)
        for _ in range(missing):
            threading.Thread(target=self._make, daemon=True).start()

    def _make(self) -> None:
        try:
            kv = lip.kv_create()
        except lip.LipError:         # refused (a quota, no session): made on demand instead
            kv = None
        with self.lock:
            self.making -= 1
            if kv is not None:
                self.ready.append(kv)


class PrefixCache:
    def __init__(self, folder: str, max_files: int = 16, min_tokens: int = 16,
                 spares: int = 0) -> None:
        self.folder = folder
        self.max_files = max_files
        self.min_tokens = min_tokens
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.lock = threading.Lock()        # held for no call to predd or the mount
        self.changed = threading.Condition(self.lock)   # a promised file came
        self.moving: set[str] = set()       # files being saved or removed: not saved anew
        self.coming: dict[int, Entry] = {}  # promised files, by promise
        self._promises = itertools.count(1)
        self.empty = EmptyCaches(spares) if spares else None
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
        most all of them), and that prefix's length (0: an empty cache). Where a file
        promised (`promise`) would hold a longer prefix than any kept, it waits for that
        file, up to COMING_WAIT_S."""
        tag = scope_tag(scope)
        with self.lock:
            best, best_len = self._best(tag, tokens)
            awaited = {n for n, e in self.coming.items() if e.scope == tag and
                       common_prefix(e.tokens, tokens) > max(best_len, self.min_tokens - 1)}
            if awaited:     # those promises alone: woken by others' saves, it waits on
                self.changed.wait_for(lambda: awaited.isdisjoint(self.coming), COMING_WAIT_S)
                best, best_len = self._best(tag, tokens)
            if best is not None and best_len >= self.min_tokens:
                self.entries.move_to_end(best)
                chosen = self.entries[best]
                stored = len(chosen.tokens)
            else:
                best = None
        # predd answers between steps: a call made under the lock would let one request
        # through a step
        if best is None:
            return self.fresh(), 0
        try:
            with lip.kv_open(best) as src:
                kv = lip.kv_fork(src)
        except lip.LipError:
            # removed meanwhile (by us or by hand): forgotten; refused (no room, the rate
            # limit): kept, for its pages to go when it is evicted or dropped
            if not os.path.exists(best):
                with self.lock:
                    if self.entries.get(best) is chosen:
                        del self.entries[best]
            return self.fresh(), 0
        if stored > best_len:
            lip.kv_truncate(kv, best_len)
        return kv, best_len

    def fresh(self) -> lip.KV:
        """An empty read-write cache: one made ahead where there are spares."""
        return self.empty.take() if self.empty is not None else lip.kv_create()

    def _best(self, tag: str, tokens: list[int]) -> tuple[str | None, int]:
        """The kept file of scope `tag` sharing the longest prefix with `tokens`."""
        best, best_len = None, 0
        for path, e in self.entries.items():
            if e.scope == tag:
                n = common_prefix(e.tokens, tokens)
                if n > best_len:
                    best, best_len = path, n
        return best, best_len

    def promise(self, scope: str, tokens: list[int]) -> int:
        """A file beginning with `tokens` is coming (`keep`): a request can answer before
        its file is saved (a save is calls through the mount to predd, each answered
        between steps), and a lookup the file would serve better still finds it."""
        promise = next(self._promises)
        with self.lock:
            self.coming[promise] = Entry(scope_tag(scope), list(tokens))
        return promise

    def keep(self, promise: int, scope: str, kv: lip.KV) -> str | None:
        """Save `kv` as promised (`store`); the promise ends whatever happens."""
        try:
            return self.store(scope, kv, lip.kv_tokens(kv))
        finally:
            self.withdraw(promise)

    def withdraw(self, promise: int) -> None:
        """A promise ends: kept (`keep`), or its cache went back for room."""
        with self.lock:
            self.coming.pop(promise, None)
            self.changed.notify_all()

    def store(self, scope: str, kv: lip.KV, tokens: list[int]) -> str | None:
        """Keep `kv` (holding exactly `tokens`) as a file; returns its path, or None
        when it adds nothing."""
        if len(tokens) < self.min_tokens:
            return None
        tag = scope_tag(scope)
        digest = hashlib.sha256(repr(tokens).encode()).hexdigest()[:24]
        path = os.path.join(self.folder, f"{tag}-{digest}.kv")
        with self.lock:
            if path in self.moving:                 # another request saves or removes it
                return None
            for old, e in self.entries.items():
                if e.scope == tag and common_prefix(e.tokens, tokens) == len(tokens):
                    self.entries.move_to_end(old)   # already have it (or more)
                    return None
            self.moving.add(path)
        try:                  # the calls outside the lock, as in lookup
            lip.kv_save(kv, path)
        finally:
            with self.lock:
                self.moving.discard(path)
        with self.lock:
            self.entries[path] = Entry(tag, list(tokens))
            gone = [old for old, e in self.entries.items() if old != path and e.scope == tag
                    and common_prefix(e.tokens, tokens) == len(e.tokens)]   # it extends
            for old in gone:
                self.entries.pop(old)
            while len(self.entries) > self.max_files:
                gone.append(self.entries.popitem(last=False)[0])
            self.moving.update(gone)
        self._unlink(gone)
        return path

    def drop_all(self) -> bool:
        """Remove every file (predd has no room: their pages go back, except those a
        request's fork still holds); False when there was none."""
        with self.lock:
            paths = list(self.entries)
            self.entries.clear()
            self.moving.update(paths)
        self._unlink(paths)
        return bool(paths)

    def _unlink(self, paths: list[str]) -> None:
        """Remove files already forgotten (in `moving` until they are gone, so that no
        save of the same tokens is undone by a late unlink)."""
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        with self.lock:
            self.moving.difference_update(paths)
