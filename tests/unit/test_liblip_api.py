"""liblip's calls against fake predds (real ZeroMQ, canned replies): the cached `info`
belongs to the predd it came from."""
from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest
import zmq

import liblip as lip
from liblip import api

VOCAB = 8


class FakePredd:
    """A ROUTER socket that answers every request with `reply(request)` (a header and
    binary frames) and keeps the requests it got."""

    def __init__(self, addr: str, model: str) -> None:
        self.addr, self.model = addr, model
        self.requests: list[dict] = []
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def ops(self, op: str) -> list[dict]:
        return [r for r in self.requests if r["op"] == op]

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, head, *_ = self._sock.recv_multipart()
            request = msgpack.unpackb(head)
            if request["op"] != "ping":
                self.requests.append(request)
            header, frames = self.reply(request)
            self._sock.send_multipart([identity, msgpack.packb(
                {"rid": request["rid"], "ok": True, **header}), *frames])

    def reply(self, r: dict) -> tuple[dict, list[bytes]]:
        cost = {"computed": len(r.get("tokens", [])), "reused": 0}
        if r["op"] == "info":
            return {"model": self.model, "vocab_size": VOCAB, "eos_ids": [2]}, []
        if r["op"] != "pred":
            return {}, []
        rows = r.get("outputs", [len(r["tokens"]) - 1])
        if "sample" in r:
            return {"token": 10 + rows[-1], "logprob": -0.5, "tokens": [10 + o for o in rows],
                    "logprobs": [-0.5] * len(rows), "cost": cost}, []
        if "topk" in r:
            k = r["topk"]
            return {"topk_ids": [list(range(o, o + k)) for o in rows],
                    "topk_logprobs": [[-1.0 * j for j in range(k)] for _ in rows],
                    "cost": cost}, []
        logits = np.array([[o * 10 + v for v in range(VOCAB)] for o in rows], np.float32)
        return {"logits": {"shape": list(logits.shape) if rows else [0, 0]},
                "cost": cost}, [logits.tobytes()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)


@pytest.fixture
def fakes(tmp_path):
    """Two fake predds; liblip's process-wide client is put back as it was after."""
    saved = api._client, api._info
    made = [FakePredd(f"ipc://{tmp_path}/{name}.sock", name) for name in ("a", "b")]
    yield made
    if api._client is not None and api._client is not saved[0]:
        api._client.close()
    api._client, api._info = saved
    for fake in made:
        fake.close()


def test_info_cached_asks_once_per_predd_and_again_after_connect(fakes):
    a, b = fakes
    lip.connect(a.addr)
    assert lip.info_cached()["model"] == "a"
    assert lip.info_cached()["model"] == "a"
    assert len(a.ops("info")) == 1
    lip.connect(b.addr)
    assert lip.info_cached() == {"model": "b", "vocab_size": VOCAB, "eos_ids": [2]}
    assert len(b.ops("info")) == 1
    lip.connect(a.addr)                       # back again: a new connection asks again
    assert lip.info_cached()["model"] == "a"
    assert len(a.ops("info")) == 2
    assert lip.info()["model"] == "a" and len(a.ops("info")) == 3   # info() never caches
