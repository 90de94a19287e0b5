"""A step's tokens picked where its logits are (predd/engine/outputs.py): on a GPU the ids
and logprobs come to the host, not the rows, and what they pick is what the host picks
from the same rows; every block a call still holds is on the host afterwards (`to_host`).
Skipped without CUDA; `scripts/gpu_check.sh` runs tests/gpu on a GPU machine."""
from __future__ import annotations

import pytest
import torch

import symphony_protocol as p
from predd.engine import outputs, sampling
from predd.engine.calls import Call

pytestmark = pytest.mark.gpu

V = 5000
GREEDY = p.SampleParams(temperature=0.0)


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


def call(*blocks: torch.Tensor, **fields) -> Call:
    return Call(1, 1, total=1, tokens=[1], logits=list(blocks), **fields)


def seeded(seed: int, **fields) -> p.SampleParams:
    return p.SampleParams(seed=seed, **fields)


def picks_of(device: str) -> list:
    """The same step's calls, their rows on `device`: what pick_tokens and to_host leave."""
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[11, 12, 13]] = True
    hot = [seeded(3, temperature=1.0), seeded(4, temperature=0.7, top_k=20),
           seeded(5, temperature=1.3, top_p=0.5)]
    on = [t.to(device) for t in (rows(2, 0), rows(1, 1), rows(2, 2), rows(2, 3), rows(2, 4),
                                 rows(1, 5), rows(1, 6), rows(1, 7), rows(1, 8))]
    calls = [call(on[0], generating=True),
             call(on[1], sample=GREEDY),
             *[call(on[2 + i], sample=s, outputs=[0, 1], generator=sampling.make_generator(s))
               for i, s in enumerate(hot)],
             call(on[5], sample=seeded(6, temperature=2.0), allowed=mask,
                  generator=sampling.make_generator(seeded(6))),
             call(on[6]),                                         # raw
             call(on[7], topk=4),
             call(rows(1, 9), on[8])]       # a chunk's rows on the host, then the device's
    outputs.pick_tokens(calls[:-1])
    outputs.to_host(calls)
    assert all(t.is_cpu for c in calls for t in c.logits)
    return [(c.picked, c.picks, [t.clone() for t in c.logits]) for c in calls]


def test_the_device_picks_what_the_host_picks_and_sends_back_the_rest(monkeypatch):
    monkeypatch.setattr(sampling, "cpu_kernels", lambda: None)   # torch on both sides
    host, device = picks_of("cpu"), picks_of("cuda")
    for (h_picked, h_picks, h_rows), (d_picked, d_picks, d_rows) in zip(host, device):
        if h_picked is not None:
            assert d_picked[0] == h_picked[0]
            assert d_picked[1] == pytest.approx(h_picked[1], abs=1e-4)
        if h_picks is not None:
            assert [t for t, _ in d_picks] == [t for t, _ in h_picks]
            assert [lp for _, lp in d_picks] == pytest.approx([lp for _, lp in h_picks],
                                                              abs=1e-4)
            assert d_rows == []              # answered by its picks: no row came back
        else:
            assert [r.shape for r in d_rows] == [r.shape for r in h_rows]
            for d, h in zip(d_rows, h_rows):
                assert torch.equal(d, h)     # the raw rows, exactly
    assert device[5][1][0][0] in (11, 12, 13)


def test_a_nan_row_on_the_device_is_left_to_its_call():
    bad = rows(2, 10)
    bad[1, 3] = float("nan")
    nan = call(bad.cuda(), sample=GREEDY, outputs=[0, 1])
    outputs.pick_tokens([nan])
    outputs.to_host([nan])
    assert nan.picks is not None and nan.picks[1][0] == 3    # torch's argmax, as on the host
    assert all(t.is_cpu for t in nan.logits)
