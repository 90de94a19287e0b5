"""The `lip` command: shell scripts as LIPs, against a real predd and a real mount."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

LIP = [sys.executable, "-m", "liblip.cli"]


def lip_cmd(*args: str, cwd: str | None = None, check: bool = True):
    proc = subprocess.run([*LIP, *args], capture_output=True, text=True, cwd=cwd,
                          env=os.environ.copy(), timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_info_stats_fsck(lip, predd):
    info = json.loads(lip_cmd("info").stdout)
    assert info["model"] == "SmolLM2-135M-Instruct" and info["vocab_size"] == 49152
    # float32 on this CPU: predd's own kernels, and decode from the GGUF's blocks
    assert (info["dtype"], info["attention"], info["linear"]) == ("float32", "cpu", "quantized")
    # ... and why, with the row limits predd measured at start-up (or was given)
    assert re.search(r"blocks at <= \d+ rows.* \((measured|--quant-rows)", info["linear_reason"]), \
        info["linear_reason"]
    assert (info["cuda_graphs"], info["cuda_graphs_reason"]) == (
        False, "auto: CUDA graphs need a CUDA device, not cpu")
    assert (info["layer_loop"], info["layer_loop_reason"]) == (True, "")   # predd's default
    assert (info["cascade"], info["cascade_reason"]) == (      # on by default; blocks are bf16
        False, "it runs in bfloat16, the model is float32")
    stats = json.loads(lip_cmd("stats").stdout)
    assert {"pages_total", "pages_free", "steps", "calls", "tokens_computed",
            "tokens_reused", "queue_wait_ms", "step_ms"} <= set(stats)
    fsck = lip_cmd("fsck")
    assert json.loads(fsck.stdout)["clean"] is True
    assert lip_cmd("tokenize", "Hello world").stdout.split() == [
        str(t) for t in lip.tokenize("Hello world")]
    ps = json.loads(lip_cmd("ps").stdout)
    assert any(row["pid"] for row in ps)


def test_errors_are_errno_named(lip, predd):
    proc = lip_cmd("cat", "/nonexistent/x.kv", check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("lip: ENOENT:")
    proc = subprocess.run([*LIP, "info"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PREDD_ADDR": "ipc:///nonexistent/predd.sock"})
    assert proc.returncode == 1 and proc.stderr.startswith("lip: EIO:")


@pytest.mark.slow
def test_prefill_cat_generate_chat(lip, kvfs):
    lip_cmd("prefill", "sys.kv", "You are a terse assistant.", cwd=kvfs.mount)
    sys_tokens = lip.tokenize("You are a terse assistant.")
    assert lip_cmd("cat", "sys.kv").stdout == "You are a terse assistant."
    lip_cmd("prefill", "sys.kv", " Answer in one word.")
    assert lip_cmd("cat", kvfs.path("sys.kv")).stdout == (
        "You are a terse assistant. Answer in one word.")

    # generate continues the file's cache in place and keeps every token it printed
    kv = lip.kv_open("sys.kv")
    before = lip.kv_tokens(kv)
    expected = lip.generate(lip.kv_fork(kv), [], max_tokens=5)   # greedy, same state
    lip.kv_close(kv)
    out = lip_cmd("generate", "sys.kv", "--max-tokens", "5").stdout
    kv = lip.kv_open("sys.kv")
    after = lip.kv_tokens(kv)
    lip.kv_close(kv)
    assert after == before + expected
    assert out.rstrip("\n") == lip.detokenize(expected, skip_special=True)
    assert after[: len(sys_tokens)] == sys_tokens

    # chat: a fresh file gets the whole template; the reply is appended, turn closed
    reply = lip_cmd("chat", "q.kv", "What is 2+2?", "--max-tokens", "24").stdout
    kv = lip.kv_open("q.kv")
    text = lip.detokenize(lip.kv_tokens(kv))
    lip.kv_close(kv)
    prompt = lip.detokenize(lip.chat_template([{"role": "user", "content": "What is 2+2?"}]))
    assert text.startswith(prompt)
    assert text[len(prompt):].startswith(reply.rstrip("\n"))
    assert text.endswith("<|im_end|>\n")
    # a second turn continues the same cache without re-prefilling the history
    lip_cmd("chat", "q.kv", "And 3+3?", "--max-tokens", "8")
    kv = lip.kv_open("q.kv")
    text2 = lip.detokenize(lip.kv_tokens(kv))
    lip.kv_close(kv)
    assert text2.startswith(text + "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
