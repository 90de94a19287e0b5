"""llama.cpp as a baseline: its `llama-batched-bench` on the same GGUF file predd serves.

`make bench-setup` builds it (`python scripts/bench_llama_cpp.py build`) from the
llama.cpp sources vendored in PyPI's `llama-cpp-python` sdist (0.3.36), with cmake, for
this CPU (GGML_NATIVE), into $BENCH_DIR/llama.cpp (default ~/.cache/symphony-bench);
only the `llama-batched-bench` target. The build is keyed by the pin and the CPU's
flags: another CPU builds it again. Nothing of it goes into the project's venv.

`batched(...)` runs it for B sequences at once, each a prompt of `prompt` tokens then
`new` generated tokens, and returns per B the whole run's seconds (prompt and
generation, as B1 times Symphony's programs) and llama.cpp's own generation-only rate.
On a CPU with AMX it runs with `--no-repack`: llama.cpp's AMX matmul, which a native
build uses for Q4_0/Q4_1 weights there, crashes with SIGSEGV on SmolLM2's Q4_1 file
(llama.cpp issues #20824, and #16315 on its wrong Q4_1 results); the option leaves the
weights in their GGUF layout for its AVX-512 dot products.

    python scripts/bench_llama_cpp.py build      # what bench-setup runs
    python scripts/bench_llama_cpp.py run [--programs 1,8] [--prompt 32] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

PIN = "llama-cpp-python==0.3.36"
TARGET = "llama-batched-bench"


class Unavailable(Exception):
    """llama.cpp is not built here (or its run failed); the message says why."""


def bench_dir() -> str:
    return os.environ.get("BENCH_DIR") or os.path.expanduser("~/.cache/symphony-bench")


def home() -> str:
    return os.path.join(bench_dir(), "llama.cpp")


def flags_line() -> str:
    """/proc/cpuinfo's line of the CPU's flags ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def stamp_text() -> str:
    """The pin and a digest of the CPU's flags: a build made for another CPU is redone."""
    return f"{PIN} {hashlib.sha256(flags_line().encode()).hexdigest()[:16]}"


def options(flags: str | None = None) -> list[str]:
    """The run's options that depend on the CPU's flags (this CPU's where None):
    `--no-repack` where it has AMX."""
    flags = flags_line() if flags is None else flags
    return ["--no-repack"] if "amx_int8" in flags.partition(":")[2].split() else []


def binary() -> str:
    """The built llama-batched-bench; Unavailable where bench-setup has not built it."""
    path = os.path.join(home(), "build", "bin", TARGET)
    stamp = os.path.join(home(), ".symphony-bench-stamp")
    if not os.path.exists(path) or not os.path.exists(stamp):
        raise Unavailable(f"no {TARGET} under {home()} (run `make bench-setup`)")
    with open(stamp) as f:
        if f.read().strip() != stamp_text():
            raise Unavailable(f"{home()} was built for another CPU or pin (run `make "
                              "bench-setup`)")
    return path


def build(log=print) -> str:
    """Downloads the sdist (no binary wheel), builds the target; the binary's path."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not installed")
    out = home()
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with tempfile.TemporaryDirectory(dir=bench_dir()) as tmp:
        log(f"llama.cpp: pip download --no-binary :all: {PIN}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", PIN, "-d", tmp], check=True,
                       stdin=subprocess.DEVNULL)
        [sdist] = [n for n in os.listdir(tmp) if n.endswith(".tar.gz")]
        with tarfile.open(os.path.join(tmp, sdist)) as tar:
            tar.extractall(tmp, filter="data")
        top = sdist[:-len(".tar.gz")]
        source = os.path.join(tmp, top, "vendor", "llama.cpp")
        build_dir = os.path.join(out, "build")
        log(f"llama.cpp: cmake {TARGET} for this CPU (minutes)")
        subprocess.run(["cmake", "-S", source, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=OFF"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", build_dir, "--target", TARGET,
                        f"-j{os.cpu_count() or 2}"], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, ".symphony-bench-stamp"), "w") as f:
        f.write(stamp_text() + "\n")
    return binary()


ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|\s*([\d.]+)\s*\|"
                 r"\s*[\d.]+\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def parse(text: str) -> dict[int, tuple[float, float]]:
    """llama-batched-bench's table: B -> (whole run's seconds, generation tokens/s)."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            b, t_total, s_tg = int(m.group(3)), float(m.group(7)), float(m.group(6))
            rows[b] = (t_total, s_tg)
    return rows


def batched(gguf: str, programs: list[int], prompt: int, new: int, threads: int,
            repeat: int = 1, log=print) -> dict[int, tuple[float, float]]:
    """B -> (best seconds for B prompts of `prompt` tokens and `new` tokens each, that
    run's generation-only tokens/s)."""
    exe = binary()
    ctx = max(programs) * (prompt + new) + 64
    argv = [exe, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt),
            "-ntg", str(new), "-npl", ",".join(map(str, programs)), "-t", str(threads)]
    extra = options()
    if extra:
        argv += extra
        log(f"bench: llama.cpp with {' '.join(extra)} (its AMX path fails on this CPU)")
    best: dict[int, tuple[float, float]] = {}
    for _ in range(repeat):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        rows = parse(done.stdout + done.stderr)
        if done.returncode != 0 or not rows:
            raise Unavailable(f"{TARGET} exited {done.returncode}: "
                              f"{(done.stderr or done.stdout).strip()[-300:]}")
        for b, r in rows.items():
            if b not in best or r[0] < best[b][0]:
                best[b] = r
    for b, (seconds, tg) in sorted(best.items()):
        log(f"bench: llama.cpp x{b}: {seconds:.2f}s ({b * new / seconds:.0f} tokens/s with "
            f"the prompts, {tg:.0f} generating)")
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["build", "run"])
    ap.add_argument("--programs", default="1,8")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    try:
        if args.what == "build":
            print(build())
            return 0
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from predd.model.loader import default_model_path
        batched(default_model_path(), [int(n) for n in args.programs.split(",")],
                args.prompt, args.new_tokens, os.cpu_count() or 2)
    except (Unavailable, subprocess.CalledProcessError) as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
