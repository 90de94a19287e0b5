"""liblip's calls against fake predds (real ZeroMQ, canned replies): what each pred call
puts on the wire and the one type it returns, that the cached `info` belongs to the
predd it came from, and that text reaches the user in whole characters."""
from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest
import zmq

import liblip as lip
from liblip import api

VOCAB = 8
BYTES = {1: b"\xc3", 2: b"</s>", 3: b"\xa9", 4: b"!"}   # 1 + 3 = "\u00e9"; 2 is special


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
        if r["op"] == "detokenize":
            raw = b"".join(BYTES[t] for t in r["tokens"] if not (r["skip_special"] and t == 2))
            return {"text": raw.decode("utf-8", errors="replace")}, []
        if r["op"] == "kv_fork":
            return {"cap": "f" * 32, "rights": r["rights"]}, []
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


def test_each_pred_call_sends_one_kind_of_request_and_returns_one_type(fakes):
    a, _ = fakes
    lip.connect(a.addr)
    kv = lip.KV.from_capability("c" * 32)

    d = lip.pred(kv, [5, 6, 7])
    assert type(d) is lip.Distribution
    assert d.logits.tolist() == [20.0 + v for v in range(VOCAB)]   # row of output 2
    assert d.cost == {"computed": 3, "reused": 0}
    assert a.requests[-1] == {"op": "pred", "rid": a.requests[-1]["rid"],
                              "cap": kv.cap, "tokens": [5, 6, 7]}

    ds = lip.pred_outputs(kv, [5, 6, 7], [0, 2], positions=[3, 4, 5], mask=[1, 4])
    assert [type(x) for x in ds] == [lip.Distribution, lip.Distribution]
    assert [x.argmax() for x in ds] == [VOCAB - 1, VOCAB - 1]
    assert [x.logits[0] for x in ds] == [0.0, 20.0]
    sent = a.requests[-1]
    assert (sent["outputs"], sent["positions"], sent["mask"]) == ([0, 2], [3, 4, 5], [1, 4])
    assert lip.pred_outputs(kv, [5], []) == []   # appends only
    assert a.requests[-1]["outputs"] == []

    s = lip.pred_sample(kv, [5, 6, 7], {"temperature": 0.0})
    assert s == lip.Sampled(12, -0.5, [12], [-0.5], {"computed": 3, "reused": 0})
    assert a.requests[-1]["sample"] == {"temperature": 0.0} and "outputs" not in a.requests[-1]
    s = lip.pred_sample(kv, [5, 6, 7], {"seed": 1}, outputs=[0, 1], mask=b"\x01")
    assert (s.token, s.tokens) == (11, [10, 11]) and a.requests[-1]["mask"] == b"\x01"

    t = lip.pred_topk(kv, [5, 6, 7], 3)
    assert t == lip.TopK([2, 3, 4], [0.0, -1.0, -2.0], [([2, 3, 4], [0.0, -1.0, -2.0])],
                         {"computed": 3, "reused": 0})
    assert a.requests[-1]["topk"] == 3
    t = lip.pred_topk(kv, [5, 6, 7], 2, outputs=[0, 1])
    assert t.ids == [1, 2] and t.per_output == [([0, 1], [0.0, -1.0]), ([1, 2], [0.0, -1.0])]

    # docs/design.md §2's keyword forms of pred are the same requests with the same answers.
    assert lip.pred(kv, [5, 6, 7], sample={"temperature": 0.0}) == lip.Sampled(
        12, -0.5, [12], [-0.5], {"computed": 3, "reused": 0})
    ids, logprobs = lip.pred(kv, [5, 6, 7], topk=3)
    assert (ids, logprobs) == ([2, 3, 4], [0.0, -1.0, -2.0])
    assert a.requests[-1]["topk"] == 3
    assert [x.logits[0] for x in lip.pred(kv, [5, 6, 7], outputs=[0, 2])] == [0.0, 20.0]

    assert lip.prefill(kv, [5, 6], positions=[9, 10]) == {"computed": 2, "reused": 0}
    sent = a.requests[-1]
    assert (sent["outputs"], sent["positions"]) == ([], [9, 10])
    assert "sample" not in sent and "topk" not in sent


def test_pred_calls_refuse_what_has_no_answer_before_asking(fakes):
    a, _ = fakes
    lip.connect(a.addr)
    kv = lip.KV.from_capability("c" * 32)
    before = len(a.requests)
    with pytest.raises(lip.LipError) as exc:
        lip.pred_sample(kv, [5], {"temperature": 0.0}, outputs=[])
    assert exc.value.code == "EINVAL"
    with pytest.raises(lip.LipError) as exc:
        lip.pred_sample(kv, [5], None)
    assert exc.value.code == "EINVAL"
    with pytest.raises(lip.LipError) as exc:
        lip.pred_topk(kv, [5], 3, outputs=[])
    assert exc.value.code == "EINVAL"
    with pytest.raises(lip.LipError) as exc:
        lip.pred_topk(kv, [5], 0)
    assert exc.value.code == "EINVAL"
    with pytest.raises(lip.LipError) as exc:
        lip.pred(kv, [5], sample={"temperature": 0.0}, topk=3)
    assert exc.value.code == "EINVAL"
    assert len(a.requests) == before


def test_text_stream_writes_whole_characters_and_no_special_tokens(fakes, capsys):
    lip.connect(fakes[0].addr)
    stream = lip.TextStream()
    shown = []
    for token in (4, 1, 3, 2, 4):
        stream.feed(token)
        shown.append(capsys.readouterr().out)
    assert shown == ["!", "", "\u00e9", "", "!"]       # half of é waits for its other byte
    assert stream.tokens == [4, 1, 3, 2, 4]
    assert lip.stream_text(iter([1, 3, 4])) == [1, 3, 4]
    assert capsys.readouterr().out == "\u00e9!"


def test_a_handle_on_another_replica_calls_that_replica(fakes):
    a, b = fakes
    lip.connect(a.addr)
    here = lip.KV.from_capability("a" * 32)
    there = lip.KV("b" * 32, "r", replica=b.addr)
    same = lip.KV("c" * 32, "rw", replica=a.addr)       # named, but this process's own
    try:
        lip.pred(there, [5])
        lip.kv_stat(there)
        forked = lip.kv_fork(there)
        lip.pred(here, [6])
        lip.pred(same, [7])
        def calls(fake):
            return [(r["op"], r["cap"]) for r in fake.requests if "cap" in r]

        assert calls(b) == [
            ("pred", "b" * 32), ("kv_stat", "b" * 32), ("kv_fork", "b" * 32)]
        assert calls(a) == [("pred", "a" * 32), ("pred", "c" * 32)]
        assert forked.replica == b.addr                     # a fork stays where it is
        assert lip.client_of(there) is lip.client_of(forked) is not lip.client()
        with pytest.raises(lip.LipError) as err:
            lip.kv_merge([here, there])
        assert err.value.code == "EXDEV"
        assert not [r for r in a.requests + b.requests if r["op"] == "kv_merge"]
    finally:
        for other in api._others.values():
            other.close()
        api._others.clear()
