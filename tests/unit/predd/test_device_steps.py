"""The engine over a runner whose logits stay on a device (`Runner.execute(host=False)` on a
GPU; here `OnDevice` tensors from tests/unit/engine_fakes.py, whose `numpy()` raises and
which refuse to join host tensors): every answer is the one a host step gives, no
device tensor reaches what needs the host's, and no batched pick fails."""
from __future__ import annotations

import numpy as np
import pytest

from predd.engine import outputs
from tests.unit.engine_fakes import VOCAB, Harness, OnDevice

A = b"a"
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "seed": 11}


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr(outputs, "_to_device", lambda block, _: block.as_subclass(OnDevice))

    def make(**config) -> Harness:
        h = Harness(**config)
        h.runner.on_device = True
        return h
    return make


def session(h: Harness) -> list:
    """A program's calls: pred_sample loops (greedy, seeded, masked), a raw pred, top-k, a
    pred whose outputs span chunks, a generate; what each answered."""
    got = []
    for sample in (GREEDY, SEEDED):
        kv = h.ok(A, "kv_create")["cap"]
        token = h.ok(A, "pred", cap=kv, tokens=[5, 6, 7], sample=sample)["tokens"][0]
        for _ in range(6):
            token = h.ok(A, "pred", cap=kv, tokens=[token], sample=sample)["tokens"][0]
            got.append(token)
        got.append(h.ok(A, "pred", cap=kv, tokens=[token], sample=sample,
                        mask=[3, 9])["tokens"])
        h.ok(A, "kv_free", cap=kv)
    kv = h.ok(A, "kv_create")["cap"]
    rid = h.send(A, "pred", cap=kv, tokens=[1, 2, 3])          # a raw row, as a frame
    h.drain()
    (frame,) = [f for i, head, f in h.replies if i == A and head["rid"] == rid][0]
    got.append(np.frombuffer(frame, np.float32).tolist())
    got.append(h.ok(A, "pred", cap=kv, tokens=[4], topk=3)["topk_ids"])
    long = list(range(1, 41))                                  # chunks of 16: 3 steps
    got.append(h.ok(A, "pred", cap=kv, tokens=long, sample=SEEDED,
                    outputs=[0, 20, 39])["tokens"])
    got.append(h.ok(A, "generate", cap=kv, tokens=[7], max_tokens=8,
                    stop=[], stream=False)["tokens"])
    assert h.ok(A, "fsck")["clean"]
    return got


def test_a_device_step_answers_as_a_host_step(device):
    OnDevice.copies.clear()
    on_device = device()
    assert session(on_device) == session(Harness())
    assert on_device.ok(A, "stats")["batch_picks_failed"] == 0
    # rows that came back to the host: the raw row, top-k's row, the spanning pred's
    # rows of its first two steps (its last joined the device's for the pick), never a
    # pred_sample's or a generate's; else only the greedy picks' ids and logprobs
    assert [c for c in OnDevice.copies if c[-1] == VOCAB] == [(1, VOCAB)] * 4
    assert all(c[0] == 2 for c in OnDevice.copies if c[-1] != VOCAB)
    on_device.clean()
