"""A cache that lives on the disk tier survives a restart of both daemons through
kvfsd's fsync (the disk tier itself is swap and dies with predd: docs/memory.md), from a
float32 pool and from a bfloat16 one under the float32 model (predd --kv-dtype)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import start_predd
from tests.integration.kvfs_fixtures import finish, pred_logits, sh, start_kvfsd

ARGS = ("--kv-pages", "32", "--disk-pages", "64", "--max-step-tokens", "256", "--lease", "3")


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_a_cache_on_disk_is_fsynced_and_restored_bit_exact(tmp_path, kv):
    import liblip as lip
    rundir, state = str(tmp_path / "run"), str(tmp_path / "state")
    args = (*ARGS, "--kv-dtype", kv)
    predd = start_predd(rundir, *args)
    lip.connect(predd.addr, dead_after_s=60)
    assert lip.info()["kv_dtype"] == kv
    kvfs = start_kvfsd(predd.addr, state)
    try:
        m = kvfs.mount
        tokens = np.random.default_rng(3).integers(100, 40000, 250).tolist()
        assert sh("touch a.kv", cwd=m).returncode == 0
        with lip.kv_open(f"{m}/a.kv", write=True) as kv:
            lip.prefill(kv, tokens)
        want = pred_logits(lip, f"{m}/a.kv", 42)
        with lip.kv_open(f"{m}/a.kv", write=True) as kv:
            assert lip.kv_policy(kv, evict=True)["tier"] == "disk"
        assert sh("getfattr -n user.kv.tier --only-values a.kv", cwd=m).stdout == "disk"
        assert sh("sync a.kv", cwd=m).returncode == 0       # exported from the disk tier
        finish(kvfs, clear=False)
        lip.client().close()
        assert predd.stop() == 0

        predd = start_predd(rundir, *args)
        lip.connect(predd.addr, dead_after_s=60)
        kvfs = start_kvfsd(predd.addr, state)
        m = kvfs.mount
        with lip.kv_open(f"{m}/a.kv") as kv:
            assert lip.kv_tokens(kv) == tokens
            assert lip.kv_stat(kv)["tier"] == "device"
        assert np.array_equal(pred_logits(lip, f"{m}/a.kv", 42), want)
    finally:
        finish(kvfs, clear=predd.proc.poll() is None)
        lip.client().close()
        predd.stop()
