"""The KV pool's dtype (predd --kv-dtype): bfloat16 under a float32 model on the CPU, taken
by `auto` where `--dtype auto` chose float32; other pairs refused before the model loads;
a predd serving from such a pool says so, holds half the bytes a page, and its caches
travel to a float32 pool and back (widened exactly, rounded as torch rounds)."""
from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from predd.memory.kvstore import EXPORT_MAGIC, parse_export
from predd.worker.runner import Runner, RunnerConfig
from tests.conftest import ROOT, start_predd


@pytest.mark.parametrize("kw, kv, reason", [
    (dict(dtype_auto=True), torch.bfloat16,
     "auto: a float32 model on the CPU, its attention reading bfloat16 entries"),
    (dict(), torch.float32, "auto: the model's dtype"),            # float32 asked for
    (dict(dtype_auto=True, attention="torch"), torch.float32, "auto: the model's dtype"),
    (dict(kv_dtype="bfloat16", attention="torch"), torch.bfloat16, "asked for"),
    (dict(kv_dtype="float32", dtype_auto=True), torch.float32, "asked for"),
])
def test_the_pool_takes_the_dtype_auto_or_asked_for_chooses(gguf_path, kw, kv, reason):
    kw = {"attention": "cpu", **kw}
    runner = Runner(RunnerConfig(gguf_path, "cpu", "float32", kv_pages=4, **kw))
    assert (runner.kv_dtype, runner.kv_dtype_reason) == (kv, reason)
    assert runner.cache.kv.dtype == kv
    assert runner.cache.bytes_per_page == 30 * 2 * 16 * 3 * 64 * (2 if kv == torch.bfloat16
                                                                   else 4)


@pytest.mark.parametrize("dtype, kv", [("bfloat16", "float32"), ("float32", "float16")])
def test_any_other_pair_is_einval_before_the_model_loads(gguf_path, dtype, kv, monkeypatch):
    from predd.worker import runner as runner_mod
    monkeypatch.setattr(runner_mod, "load_weights", lambda *a: pytest.fail("loaded"))
    want = ("--kv-dtype float32: the pool holds the model's dtype (bfloat16), or bfloat16 "
            "under a float32 model on the CPU (EINVAL)" if kv == "float32" else
            "--kv-dtype must be one of auto, float32, bfloat16, not 'float16' (EINVAL)")
    with pytest.raises(ValueError) as err:
        Runner(RunnerConfig(gguf_path, "cpu", dtype, kv_pages=4, attention="cpu",
                            kv_dtype=kv))
    assert str(err.value) == want


def test_predd_refuses_a_pair_at_start_saying_why(tmp_path):
    run = subprocess.run([sys.executable, "-m", "predd", "--dtype", "bfloat16", "--kv-dtype",
                          "float32", "--rundir", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert ("--kv-dtype float32: the pool holds the model's dtype (bfloat16), or bfloat16 "
            "under a float32 model on the CPU (EINVAL)") in run.stderr


def _entries(blob: bytes) -> np.ndarray:
    """An export's K/V as it holds them (float32, or bfloat16's bits as uint16)."""
    head_len = int.from_bytes(blob[len(EXPORT_MAGIC):len(EXPORT_MAGIC) + 4], "little")
    at = len(EXPORT_MAGIC) + 4
    meta = msgpack.unpackb(blob[at:at + head_len])
    mine = {k: meta[k] for k in ("model", "dtype", "numpy_dtype", "layers", "kv_heads",
                                 "head_dim")}
    return parse_export(blob, mine, 1 << 20, 1 << 20)[3]


@pytest.mark.slow
def test_a_bfloat16_pool_serves_and_its_caches_move_to_a_float32_pool_and_back(lip, tmp_path):
    """The shared predd's pool is float32; another with `--kv-dtype bfloat16` computes the
    same greedy tokens here, and a cache exported from either imports into the other:
    into bfloat16 rounded as torch rounds, back into float32 widened to the bit."""
    prompt = [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30] * 4
    wide = lip.info()
    assert (wide["dtype"], wide["kv_dtype"]) == ("float32", "float32")
    obj = lip.kv_create()
    want = list(lip.generate(obj, prompt, max_tokens=12, ignore_eos=True))
    f32_blob = lip.kv_export(obj)
    lip.kv_free(obj)

    other = start_predd(str(tmp_path / "bf"), "--kv-pages", "64", "--kv-dtype", "bfloat16")
    try:
        lip.connect(other.addr)
        info = lip.info()
        assert (info["dtype"], info["kv_dtype"], info["kv_dtype_reason"]) == (
            "float32", "bfloat16", "asked for")
        assert info["bytes_per_page"] * 2 == wide["bytes_per_page"]
        obj = lip.kv_create()
        assert list(lip.generate(obj, prompt, max_tokens=12, ignore_eos=True)) == want
        blob = lip.kv_export(obj)
        imported = lip.kv_import(f32_blob)             # float32 entries, rounded
        assert lip.kv_tokens(imported) == lip.kv_tokens(obj) == prompt + want[:-1]
        rounded = _entries(lip.kv_export(imported))
        assert lip.fsck()["clean"]
    finally:
        lip.client().close()
        assert other.stop() == 0
    lip.connect(os.environ["PREDD_ADDR"])
    sent = _entries(f32_blob)
    assert rounded.dtype == np.uint16 and np.array_equal(
        rounded, torch.from_numpy(sent.copy()).to(torch.bfloat16).view(torch.uint16).numpy())
    back = lip.kv_import(blob)                         # bfloat16 entries, widened
    widened = _entries(lip.kv_export(back))
    lip.kv_free(back)
    assert widened.dtype == np.float32
    assert np.array_equal(widened, (_entries(blob).astype(np.uint32) << 16).view(np.float32))
    assert 0 < np.abs(widened - sent).max() < 0.05 * np.abs(sent).max()
