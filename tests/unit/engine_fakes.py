"""A real Engine over a fake runner and tokenizer: requests in, replies out, no model.

`FakeRunner.execute` behaves like the model where it matters here: it writes every
chunk's K/V (the `payload` of test_kvstore: token, position, layer, K-or-V) into the
chunk's own slots, then gives each wanted output a distribution that depends on every
token the output attends to, read back from the cache — so an entry that is missing,
doubled or half-written changes the tokens a call gets. `fail` picks chunks whose
pass raises; like a real failure mid-pass, the pass has already scribbled NaN over the
failing chunk's slots by then.
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import msgpack
import numpy as np
import torch

from predd.engine.config import EngineConfig
from predd.engine.core import Engine
from predd.server.handlers import HANDLERS
from predd.server.identity import Peer
from predd.attention.page_table import PageTables
from predd.engine.scheduler import SchedulerConfig
from tests.unit.predd.kvstore_world import LAYERS, FakePages, payload

VOCAB = 64


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on a device: what a GPU step's logits are to the engine
    (`Runner.execute(host=False)`). `cpu()` makes a plain copy (its rows counted in
    `OnDevice.copies` by shape); `numpy()` raises, as a CUDA tensor's does; and joining it with
    host tensors raises, as torch does for tensors on two devices."""
    copies: list[tuple[int, ...]] = []

    @property
    def is_cpu(self) -> bool:
        return False

    def cpu(self) -> torch.Tensor:
        OnDevice.copies.append(tuple(self.shape))
        return self.as_subclass(torch.Tensor).clone()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert a device tensor to numpy: copy it to the host first")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.cat, torch.stack) and args and \
                len({type(t) is cls for t in args[0]}) > 1:
            raise RuntimeError("Expected all tensors to be on the same device")
        return super().__torch_function__(func, types, args, kwargs or {})
# Every fake client is this process over ipc, as kernel credentials name it: the
# operator (trusted), as the tests that ran before identity came from the kernel.
ME = Peer(f"localhost:{os.geteuid()}:{os.getegid()}:{os.getpid()}",
          os.geteuid(), os.getegid(), os.getpid())
CONTEXT = 256


def still(stat: dict) -> dict:
    """A kv_stat reply without its clock (`idle_s`): what must not change."""
    return {k: v for k, v in stat.items() if k != "idle_s"}


class FakeCache(FakePages):
    bytes_per_page = 1024


class FakeRunner:
    def __init__(self, kv_pages: int = 64, page_size: int = 4, context: int = CONTEXT) -> None:
        self.config = SimpleNamespace(kv_pages=kv_pages, page_size=page_size, device="cpu",
                                      dtype="float32", dtype_reason="fake")
        self.model_config = SimpleNamespace(name="fake", vocab_size=VOCAB, max_position=context,
                                            num_layers=LAYERS)
        self.cache = FakeCache(kv_pages, page_size)
        self.backend = SimpleNamespace(name="fake")
        self.linear = "plain"
        self.linear_reason = "fake"
        self.graphs, self.graphs_reason = None, "fake"
        self.layer_loop, self.layer_loop_reason = None, "fake"
        self.cascade_reason = "fake"
        self.kv_dtype, self.kv_dtype_reason = "float32", "fake"
        self.fail = lambda chunk: False       # raise in the pass (after scribbling NaN)
        self.nan = lambda chunk: False        # NaN logits, no exception
        self.batches: list[int] = []          # chunks per execute call
        self.on_device = False                # execute(host=False): OnDevice logits
        self.flying = 0                       # a launch is ready after this many asks

    def keepalive(self) -> None:
        pass

    def execute(self, chunks, host=True):
        self.batches.append(len(chunks))
        for c in chunks:
            slots = self._slots(c)
            own = slots[len(slots) - len(c.tokens):]
            data = payload(c.tokens, c.positions)
            if self.fail(c):
                data[:] = np.nan
            self.cache.write_slots(own, data)
        for c in chunks:
            if self.fail(c):
                raise RuntimeError("injected failure")
        out = [self._logits(c) * (float("nan") if self.nan(c) else 1.0) for c in chunks]
        return out if host or not self.on_device else [t.as_subclass(OnDevice) for t in out]

    def launch(self, chunks):
        """The pass run at once, its launch not `ready` until asked `flying` times: a
        device's pass in flight, as the server sees it."""
        return FakeLaunch(self.execute(chunks, host=False), self.flying)

    def land(self, launch, host=True):
        return launch.results

    def _slots(self, c) -> np.ndarray:
        """The chunk's context as slot ids, read from its page table as a backend does."""
        tables = PageTables.build(self.config.page_size, [c.pages], [c.kv_len],
                                  [len(c.tokens)])
        return tables.slots(0, 0, c.kv_len)

    def _logits(self, c) -> torch.Tensor:
        k = self.cache.kv[0, 0, self._slots(c), 0]   # [L, D]
        rows = []
        for j in c.outputs:
            seen = k[:c.kv_len - len(c.tokens) + j + 1]
            row = torch.full((VOCAB,), -2.0)
            if np.isnan(seen).any():
                row[:] = float("nan")
            else:
                mix = int(seen[:, 0] @ np.arange(1, len(seen) + 1) + seen[:, 1].sum())
                row[(mix * 7 + 3) % VOCAB] = 3.0
                row[(mix * 5 + 1) % VOCAB] = 2.0
            rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class FakeLaunch:
    def __init__(self, results: list, flying: int) -> None:
        self.results, self.left = results, flying

    def ready(self) -> bool:
        self.left -= 1
        return self.left < 0


class FakeTokenizer:
    """Ids 0..63; id i reads as the letter chr(97 + i % 26); 0 is EOS."""
    eos_ids = [0]
    bos_id = None

    def __init__(self) -> None:
        self.decoded = 0   # ids decoded so far (the cost of stop strings)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [(ord(ch) - 97) % 26 + 1 for ch in text]

    def decode(self, ids, skip_special: bool = False) -> str:
        self.decoded += len(ids)
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "".join(m["content"] for m in messages)


class Harness:
    """An engine with its replies collected per client."""

    def __init__(self, kv_pages: int = 64, page_size: int = 4, context: int = CONTEXT,
                 token_budget: int = 16, **config) -> None:
        self.runner = FakeRunner(kv_pages, page_size, context)
        self.tokenizer = FakeTokenizer()
        self.replies: list[tuple[bytes, dict, list[bytes]]] = []
        self.logs: list[str] = []
        cfg = EngineConfig(scheduler=SchedulerConfig(token_budget=token_budget, max_batch=8),
                           **config)
        self.engine = Engine(self.runner, self.tokenizer, cfg,
                             lambda ident, head, frames: self.replies.append(
                                 (ident, head, frames)), self.logs.append,
                             handlers=HANDLERS)
        self.rid = 0

    def send(self, who: bytes, op: str, *frames: bytes, **fields) -> int:
        self.rid += 1
        head = msgpack.packb({"op": op, "rid": self.rid, **fields}, use_bin_type=True)
        self.engine.handle(who, [head, *frames], time.monotonic(), ME)
        return self.rid

    def reply(self, who: bytes, rid: int) -> dict:
        """The terminal reply to `rid` (exactly one)."""
        final = [h for i, h, _ in self.replies
                 if i == who and h["rid"] == rid and not h.get("more")]
        assert len(final) == 1, f"{len(final)} terminal replies to {rid}"
        return final[0]

    def stream(self, who: bytes, rid: int) -> list[dict]:
        return [h for i, h, _ in self.replies if i == who and h["rid"] == rid]

    def call(self, who: bytes, op: str, *frames: bytes, **fields) -> dict:
        rid = self.send(who, op, *frames, **fields)
        self.drain()
        return self.reply(who, rid)

    def ok(self, who: bytes, op: str, *frames: bytes, **fields) -> dict:
        reply = self.call(who, op, *frames, **fields)
        assert reply["ok"], reply
        return reply

    def drain(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.engine.step():
            steps += 1
            assert steps < max_steps
        return steps

    def entries(self, cap: str) -> tuple[list[int], list[int]]:
        oid = self.engine.caps.lookup(cap).oid
        t, p = self.engine.store.entries(oid)
        return t.tolist(), p.tolist()

    def kv_of(self, cap: str) -> np.ndarray:
        obj = self.engine.store.get(self.engine.caps.lookup(cap).oid)
        return self.engine.tiers.read_slots(self.engine.store.slots(obj))

    def free_pages(self) -> int:
        return self.engine.pool.free_pages

    def clean(self) -> None:
        assert self.engine.fsck() == []


