"""predd's CPU kernels as an older x86 CPU builds them ($SYMPHONY_KERNELS_MARCH): the
kernel tests and the layer-loop tests pass on the AVX2 paths (x86-64-v3: the float32 C
layer loop, the float32 and int8 block kernels, bf16 rows by float32 FMAs, attention 8
lanes wide), on AVX2 with AVX-VNNI (alderlake: Intel's client CPUs, whose int8 dot
products are VPDPBUSD on 256 bits; built where this CPU has avx_vnni) and on the plain C
paths (x86-64-v2), not only on this machine's own build; the int8 kernels give the same
bits in every build. Each build goes to a cache of its own
and runs the tests in a process of its own."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from predd.kernels import build
from predd.model.dtype import cpu_flags

ROOT = Path(__file__).resolve().parents[3]
TESTS = ["tests/unit/predd/test_cpu_kernels.py", "tests/unit/predd/test_quant_int8.py",
         "tests/unit/predd/test_quant_linear.py",
         "tests/integration/predd/test_layer_loop.py"]
# the int8 kernels' result for fixed blocks and rows, without and with a bias (70 weight
# rows: the last group of 8 is partial; 19 rows of x: with AVX512-VNNI, whole groups two
# at a time), as bytes' digest: the portable build makes the vector build's operations in
# the same order
INT8_DIGEST = (
    "import hashlib, torch; from predd.kernels import cpu_kernels as c, probes as p; k = c.kernels(); "
    "x = torch.randn(19, 576, generator=torch.Generator().manual_seed(0)); "
    "b = torch.randn(70, generator=torch.Generator().manual_seed(1)); "
    "print(k.int8_dots, hashlib.sha256(b''.join(k.bind(p.random_blocks(kind, 70, 576)[0], "
    "bias, int8=True)(x).numpy().tobytes() for kind in ('Q4_1', 'Q8_0') "
    "for bias in (None, b))).hexdigest())")

# the builds this CPU runs besides its own, and what each sums int8 blocks with
OLDER = {"x86-64-v3": "avx2", "x86-64-v2": "portable",
         **({"alderlake": "vnni"} if "avx_vnni" in cpu_flags() else {})}

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which(os.environ.get("CC", "cc"))
    is None, reason="x86-64 -march levels need an x86 machine and its C compiler")


@pytest.mark.parametrize("march", list(OLDER))
def test_the_kernels_built_for_an_older_cpu_pass_the_kernel_tests(march, tmp_path):
    env = {**os.environ, build.MARCH_ENV: march, "SYMPHONY_CACHE": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "from predd.kernels import cpu_kernels as c; k = c.kernels(); "
         "print(c.problem(), k.bf16_blocks, k.bf16_tiles)"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # it builds and agrees with torch; bf16 rows by float32 FMAs with AVX2 (v3, alderlake),
    # none without (v2); no AMX tiles below AVX-512
    assert probe.stdout.split() == ["None", str(march != "x86-64-v2"), "False"], \
        probe.stderr[-2000:]
    assert [p.name.startswith("predd-cpu-") for p in (tmp_path / "kernels").glob("*.so")] \
        == [True]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *TESTS], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_int8_kernels_give_the_same_bits_in_every_build(tmp_path):
    digests = {}
    for march in ("native", *OLDER):
        env = {**os.environ, build.MARCH_ENV: march,
               "SYMPHONY_CACHE": str(tmp_path / march)}
        run = subprocess.run([sys.executable, "-c", INT8_DIGEST], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        how, digest = run.stdout.split()
        digests[march] = digest
        assert how == OLDER.get(march, how)
    assert len(set(digests.values())) == 1, digests


def test_a_march_that_is_not_a_name_is_refused(monkeypatch):
    monkeypatch.setenv(build.MARCH_ENV, "native -o /tmp/x")
    with pytest.raises(build.KernelUnavailable, match="is not an -march name"):
        build.flags()
