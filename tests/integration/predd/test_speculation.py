"""Speculative continuation on the real model (a predd of its own with `--speculate on`,
the CPU's default being off): a pred_sample loop takes predd's speculation at every
token after the first, gets generate's greedy tokens, and the cache, its forks and
`kv_tokens` never show a speculated token."""
from __future__ import annotations

import pytest

from tests.conftest import PREDD_ARGS, start_predd

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def predd(tmp_path_factory):
    """This module's own predd, speculating; conftest's `lip` connects to it."""
    daemon = start_predd(str(tmp_path_factory.mktemp("predd-spec")), *PREDD_ARGS,
                         "--speculate", "on")
    yield daemon
    assert daemon.stop() == 0


def spec(lip) -> dict:
    return lip.stats()["speculation"]


def test_a_pred_sample_loop_takes_every_speculation_and_leaves_no_trace(lip):
    prompt = lip.tokenize("Speculation runs the next step before the program asks:")
    want = list(lip.generate(lip.kv_create(), prompt, max_tokens=24, ignore_eos=True))
    kv = lip.kv_create()
    before = spec(lip)
    step, got = prompt, []
    for _ in range(24):
        got.append(lip.pred_sample(kv, step, GREEDY).token)
        step = [got[-1]]
    after = spec(lip)
    assert got == want
    assert after["offered"] - before["offered"] == 24
    assert after["hits"] - before["hits"] == 23
    # the 24th token's speculation is computed; reading the cache discards it unseen
    assert lip.kv_tokens(kv) == prompt + got[:-1]
    assert spec(lip)["misses"] - after["misses"] == 1
    fork = lip.kv_fork(kv)
    assert lip.kv_tokens(fork) == prompt + got[:-1]
    # the loop goes on from the fork and the original alike, and gets the same token
    a = lip.pred_sample(kv, [got[-1]], GREEDY).token
    b = lip.pred_sample(fork, [got[-1]], GREEDY).token
    assert a == b
    lip.kv_close(fork)
    lip.kv_close(kv)


def test_a_different_token_than_the_speculated_one_gets_its_own_answer(lip):
    prompt = lip.tokenize("Two roads diverged in a yellow wood")
    kv, ref = lip.kv_create(), lip.kv_create()
    first = lip.pred_sample(kv, prompt, GREEDY).token
    lip.pred(ref, prompt, outputs=[])
    other = (first + 1) % 1000
    before = spec(lip)
    got = lip.pred_sample(kv, [other], GREEDY).token
    want = lip.pred_sample(ref, [other], GREEDY).token
    assert got == want
    assert spec(lip)["misses"] - before["misses"] >= 1
    assert lip.kv_tokens(kv) == prompt + [other]
    lip.kv_close(kv)
    lip.kv_close(ref)


def test_a_pred_loop_taking_the_argmax_is_speculated_through_the_logits_buffer(lip):
    prompt = lip.tokenize("A raw pred loop reads every row of logits:")
    want = list(lip.generate(lip.kv_create(), prompt, max_tokens=16, ignore_eos=True))
    kv = lip.kv_create()
    before = spec(lip)
    rows_before = lip.stats()["logits_rows"]
    d = lip.pred(kv, prompt)
    got = []
    for _ in range(16):
        got.append(d.argmax())
        d = lip.pred(kv, [got[-1]])
    after = spec(lip)
    assert got == want
    assert after["hits"] - before["hits"] == 15, (before, after)
    # every row, speculated or not, went back through the session's logits buffer
    rows = lip.stats()["logits_rows"]
    assert rows["buffer"] - rows_before["buffer"] == 17 and rows["frame"] == rows_before["frame"]
    lip.kv_close(kv)
