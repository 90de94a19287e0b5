"""Many LIP processes at once: batching changes nothing in what each one gets."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow        # 16 LIPs decoding at once

LIP = os.path.join(os.path.dirname(__file__), "..", "lips", "greedy.py")
PROMPTS = [f"Tell me fact number {i} about the ocean." for i in range(16)]
N = 12


def run_lips(predd, args: list[list[str]]) -> list[list[int]]:
    env = {**os.environ, "PREDD_ADDR": predd.addr}
    procs = [subprocess.Popen([sys.executable, LIP, *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for a in args]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        outs.append(json.loads(out))
    return outs


def test_16_concurrent_lips_get_their_solo_tokens(lip, predd):
    # Alone: one process at a time (batch of one).
    solo = [run_lips(predd, [[p, str(N)]])[0] for p in PROMPTS[:4]]
    before = lip.stats()
    together = run_lips(predd, [[p, str(N)] for p in PROMPTS])
    after = lip.stats()
    assert together[:4] == solo
    steps = after["steps"] - before["steps"]
    calls = after["calls"] - before["calls"]
    assert calls >= 16 * (N + 1)   # a prefill split across steps counts per step
    assert calls / steps > 1.5, f"mean batch {calls / steps:.2f}"
    # Every other prompt agrees with a single-process reference too.
    for prompt, got in zip(PROMPTS[4:], together[4:]):
        kv = lip.kv_create()
        tokens = lip.chat_template([{"role": "user", "content": prompt}])
        assert lip.generate(kv, tokens, max_tokens=N, ignore_eos=True) == got


def test_concurrent_generate_streams(lip, predd):
    together = run_lips(predd, [[p, str(N), "--generate"] for p in PROMPTS[:8]])
    for prompt, got in zip(PROMPTS[:8], together):
        kv = lip.kv_create()
        d = lip.pred(kv, lip.chat_template([{"role": "user", "content": prompt}]))
        ref = []
        for _ in range(N):
            ref.append(d.argmax())
            d = lip.pred(kv, [ref[-1]])
        assert got == ref
