"""liblip's cache calls on token lists, for the application benchmarks' unit tests: a
cache is the list of its entries' tokens, `generate` leaves its last token out of the
cache as predd's does, and every context the model saw is recorded."""
from __future__ import annotations

import contextlib
import itertools
import threading

from liblip.predict import Generated


def model(context: list[int], n: int) -> list[int]:
    """A deterministic fake LM: each token is a function of everything before it."""
    ctx, out = list(context), []
    for _ in range(n):
        out.append(hash(tuple(ctx)) % 49152)
        ctx.append(out[-1])
    return out


class FakeLip:
    LipError = RuntimeError
    Generated = Generated

    def __init__(self, **files: list[int]) -> None:
        self.caches: dict[int, list[int]] = {}
        self.names: dict[str, int] = {}
        self.seen: list[list[int]] = []
        self.sent: list[int] = []
        self.waits = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        for name, tokens in files.items():
            self.names[name] = self._new(tokens)

    def _new(self, tokens: list[int]) -> int:
        with self._lock:
            kv = next(self._ids)
            self.caches[kv] = list(tokens)
            return kv

    def kv_create(self) -> int:
        return self._new([])

    def kv_fork(self, kv: int) -> int:
        return self._new(self.caches[kv])

    def kv_extract(self, kv: int, ranges) -> int:
        return self._new([t for a, b in ranges for t in self.caches[kv][a:b]])

    def kv_merge(self, kvs) -> int:
        return self._new([t for kv in kvs for t in self.caches[kv]])

    def kv_stat(self, kv: int) -> dict:
        return {"tokens": len(self.caches[kv])}

    def prefill(self, kv: int, tokens) -> dict:
        self.caches[kv] += list(tokens)
        return {"computed": len(tokens), "reused": len(self.caches[kv]) - len(tokens)}

    def generate(self, kv: int, tokens, max_tokens: int, sample, ignore_eos: bool):
        assert sample == {"temperature": 0.0} and ignore_eos
        context = self.caches[kv] + list(tokens)
        with self._lock:
            self.seen.append(context)
            self.sent.append(len(tokens))
        out = model(context, max_tokens)
        self.caches[kv] = context + out[:-1]
        ids = Generated(out)
        ids.cost = {"computed": len(tokens), "reused": len(context) - len(tokens)}
        return ids

    def io_wait(self, kv: int):
        assert kv in self.caches
        self.waits += 1
        return contextlib.nullcontext()

    def kv_close(self, kv: int) -> None:
        del self.caches[kv]

    def open(self) -> list[int]:
        """The caches still open, besides the files."""
        return sorted(set(self.caches) - set(self.names.values()))


class FakeTokenizer:
    """One id per character (a chat template of role headers), so counts are exact."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")
