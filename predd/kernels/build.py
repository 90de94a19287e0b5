"""The build of predd's CPU kernel library (csrc/*.c, declared in csrc/kernels.h): compiled
here with the machine's C compiler (`$CC`, else `cc`) for this CPU (`-march=native`, or
`$SYMPHONY_KERNELS_MARCH`), cached under `$SYMPHONY_CACHE` (default
`~/.cache/symphony`) by a hash of the sources, the flags, the compiler and the CPU's
flags, in a directory this user alone can write (else a library someone else could
replace would be loaded).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.c", CSRC / "layer_ops.c", CSRC / "quant_linear.c",
           CSRC / "quant_tiles.c", CSRC / "quant_lanes.c", CSRC / "attention_tiles.c",
           CSRC / "greedy.c", CSRC / "layer_loop.c", CSRC / "step_plan.c", CSRC / "quant_int8.c")
HEADERS = (CSRC / "kernels.h", CSRC / "exp_approx.h", CSRC / "bf16.h", CSRC / "lanes.h", CSRC / "quant_blocks.h",
           CSRC / "amx.h", CSRC / "prefetch.h")
LIBRARY = "predd-cpu"
# -fno-trapping-math: predd never unmasks floating-point exceptions, and without it GCC
# will not turn a float compare-and-select (exp_approx's clamp) into a vector blend on
# AVX2, leaving the softmax's and SwiGLU's exponential loops scalar there.
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
# $SYMPHONY_KERNELS_MARCH names another -march (x86-64-v3: AVX2 and FMA, no AVX-512;
# x86-64-v2: neither): the library as an older CPU would build it, so that its paths for
# that CPU can be tested here (tests/integration/predd/test_kernels_march.py)
MARCH_ENV = "SYMPHONY_KERNELS_MARCH"


class KernelUnavailable(Exception):
    """The kernels cannot build, load or agree with torch here; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("SYMPHONY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "symphony")
    return Path(root) / "kernels"


def cpu_flags() -> str:
    """/proc/cpuinfo's line of the CPU's flags (else the platform's name for the CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def flags() -> tuple[str, ...]:
    """The compiler's flags: FLAGS, with $SYMPHONY_KERNELS_MARCH's -march where set."""
    march = os.environ.get(MARCH_ENV) or "native"
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise KernelUnavailable(f"${MARCH_ENV}={march!r} is not an -march name")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def build(sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS,
          name: str = LIBRARY) -> Path:
    """The library built for this machine (or found in the cache, keyed by the sources,
    the flags, the compiler and the CPU): its path; KernelUnavailable saying why not."""
    options = flags()
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C compiler ({compiler}) on PATH")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from None
    texts = [p.read_text() for p in (*sources, *headers)]
    key = hashlib.sha256("\0".join([*texts, *options, version, platform.machine(),
                                    cpu_flags()]).encode()).hexdigest()[:16]
    last_error = ""
    for where in (cache_dir(), Path(tempfile.gettempdir()) / f"symphony-kernels-{os.geteuid()}"):
        target = where / f"{name}-{key}.so"
        try:
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not owned_alone(where):     # a library someone else could replace: never load it
                last_error = f"{where} is not this user's alone"
                continue
            if target.exists():
                return target
            fd, partial = tempfile.mkstemp(suffix=".so", dir=where)
            os.close(fd)
        except OSError as exc:
            last_error = f"cannot write {where}: {exc.strerror}"
            continue
        try:
            done = subprocess.run([compiler, *options, "-o", partial, *map(str, sources)],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelUnavailable(f"{compiler} failed on {LIBRARY}: "
                                        f"{(done.stderr or done.stdout).strip()[-400:]}")
            os.replace(partial, target)      # atomic: racing builders write the same file
            return target
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise KernelUnavailable(last_error)


def owned_alone(where: Path) -> bool:
    """Whether `where` is owned by this euid and writable by no one else."""
    st = where.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022
