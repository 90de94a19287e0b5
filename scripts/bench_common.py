"""What every benchmark here shares: the log, the machine line, RESULT lines, and
starting the daemons (predd through predd.server.launch, kvfsd on a private mount).

A bench logs to stderr (`bench: ...`) and prints its results on stdout, one
`RESULT {json}` line per comparison, each with its ratio against a baseline measured
in the same run. `machine()` logs what the figures depend on: the dtype predd chose,
the CPU's vector flags and the load average when the bench started (the hosts are
shared; compare ratios from a quiet machine).
"""
from __future__ import annotations

import argparse

import json
import os
import platform
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# predd's --dtype choices (predd.model.dtype.DTYPES and auto), without importing torch here
DTYPE_CHOICES = ["auto", "bfloat16", "float16", "float32"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hardware() -> str:
    return f"{platform.machine()} {os.cpu_count()} cpu"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine(requested_dtype: str = "auto") -> str:
    """The dtype every system will use (predd's choice for `auto`); logs it with the
    CPU flags and the load average. Also makes SIGTERM unwind the bench like Ctrl-C,
    so its daemons are stopped and its mounts unmounted."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from predd.model import dtype
    global _AUTO_DTYPE
    chosen, why = dtype.resolve(requested_dtype, "cpu")
    if requested_dtype == "auto":
        _AUTO_DTYPE = chosen
    flags = sorted(f for f in dtype.cpu_flags() if f.startswith(("avx", "amx")))
    log(f"bench: dtype {chosen} ({why}); CPU flags: {' '.join(flags)}; "
        f"{hardware()}; load average {load_average()}")
    return chosen


# the dtype `machine("auto")` chose: predd is started with `--dtype auto` for it, so that
# it makes the rest of auto's choices too (int8 dot products on an AVX2 CPU: predd
# --linear), the dtype being the same
_AUTO_DTYPE: str | None = None


def result(bench: str, metric: str, ours: float, baseline: str, theirs: float,
           ratio: float | None = None, **extra) -> dict:
    """Print one RESULT line: our figure, the baseline's, and `ratio` (default ours /
    theirs; a bench whose figure is a time passes its own and says so in `ratio_is`)."""
    if ratio is None:
        ratio = round(ours / theirs, 3) if theirs else None
    record = {"bench": bench, "metric": metric, "symphony": round(ours, 6),
              "baseline": baseline, "baseline_value": round(theirs, 6), "ratio": ratio,
              **extra, "hardware": hardware()}
    print("RESULT " + json.dumps(record), flush=True)
    return record


def best_of(repeat: int, measure: Callable[[], tuple]) -> tuple:
    """The run with the smallest first element (seconds) of `repeat` runs."""
    return min((measure() for _ in range(repeat)), key=lambda r: r[0])


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def changed(before: dict, after: dict, key: str, per: float = 1.0) -> str:
    """What the map `key` of `stats` (logits_rows, time_ms) gained between two reads,
    each entry divided by `per` (to 0.1)."""
    a, b = after.get(key, {}), before.get(key, {})
    return " ".join(f"{k} {round((a[k] - b.get(k, 0)) / per, 1):g}" for k in a) or "-"


# ------------------------------------------------------------------ daemons

def start_predd(*args: str, timeout: float = 600.0):
    """A predd with `args`, then those of $SYMPHONY_BENCH_PREDD_ARGS (e.g. `--linear
    packed`), in a fresh run directory (predd.server.launch.Daemon); logs the attention backend
    and projections it chose."""
    import liblip as lip
    from predd.server import launch
    args = tuple("auto" if i and args[i - 1] == "--dtype" and a == _AUTO_DTYPE else a
                 for i, a in enumerate(args))
    args = (*args, *shlex.split(os.environ.get("SYMPHONY_BENCH_PREDD_ARGS", "")))
    daemon = launch.start(tempfile.mkdtemp(prefix="symphony-bench-"), *args, timeout=timeout)
    lip.connect(daemon.addr)                # closed again before any program forks
    info = lip.info()
    lip.client().close()
    log(f"bench: predd {' '.join(args)}: attention {info['attention']}, "
        f"linear {info.get('linear') or '?'} ({info.get('linear_reason') or '?'}), "
        f"KV {info.get('kv_dtype') or '?'} ({info.get('kv_dtype_reason') or '?'})")
    return daemon


class JsonLines:
    """A process spoken to in JSON lines (a LIP serving requests): `send` writes one
    object a line; once `start`ed, a thread hands each line it reads to the inbox of the
    line's "id" (`inbox` opens one, `done` closes it), and when the output ends, each
    open inbox gets `{"gone": True, "code": ...}`."""

    def __init__(self, argv: list[str], env: dict) -> None:
        from predd.server.launch import die_with_parent
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT, preexec_fn=die_with_parent)
        self.lock = threading.Lock()
        self.inboxes: dict = {}
        self.reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                inbox = self.inboxes.get(msg.get("id"))
            if inbox is not None:
                inbox.put(msg)
        with self.lock:
            for inbox in self.inboxes.values():
                inbox.put({"gone": True, "code": self.proc.poll()})

    def inbox(self, rid) -> queue.SimpleQueue:
        box: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            self.inboxes[rid] = box
        return box

    def done(self, rid) -> None:
        with self.lock:
            self.inboxes.pop(rid, None)

    def send(self, obj: dict) -> None:
        with self.lock:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()

    def close(self, timeout: float) -> int:
        """Its input closed: its exit code once it ends (killed after `timeout`)."""
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.reader.is_alive():
            self.reader.join(timeout=10)
        return code


class Mount:
    """kvfsd serving `addrs` (one predd, or several replicas) on a fresh mount point
    under /tmp, for a `with` block; unmounted and removed afterwards whatever happens."""

    def __init__(self, *addrs: str, timeout: float = 60.0) -> None:
        from predd.server.launch import die_with_parent, wait_ready
        self.path = tempfile.mkdtemp(prefix="kvfs-bench-", dir="/tmp")
        os.chmod(self.path, 0o755)
        self.work = tempfile.mkdtemp(prefix="kvfs-bench-state-")
        self.log = os.path.join(self.work, "kvfsd.log")
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfsd", self.path,
                 *(arg for addr in addrs for arg in ("--predd", addr)),
                 "--state", os.path.join(self.work, "state")],
                stdout=subprocess.PIPE, stderr=err, cwd=ROOT, preexec_fn=die_with_parent)
        if wait_ready(self.proc, timeout) is None:
            self.close()
            with open(self.log, errors="replace") as f:
                raise RuntimeError(f"kvfsd did not mount in {timeout:g} s: {f.read()[-2000:]}")

    def close(self) -> None:
        """Stop kvfsd; its state directory and log go too when it exited cleanly."""
        from predd.server.launch import terminate
        if terminate(self.proc, 20.0) == 0:
            shutil.rmtree(self.work, ignore_errors=True)
        self.proc.stdout.close()
        with open("/proc/mounts") as f:
            mounted = any(line.split()[1] == self.path for line in f if line.strip())
        if mounted:
            subprocess.run(["fusermount3", "-u", "-z", self.path], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> Mount:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serving_flags(ap: argparse.ArgumentParser, quick_help: str) -> None:
    """The flags every serving benchmark shares: the step budget, the dtype, the seed
    and `--quick` (what it shrinks, in `quick_help`; applied by `quick_defaults`)."""
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=quick_help)


def quick_defaults(ap: argparse.ArgumentParser, args: argparse.Namespace,
                   values: dict) -> None:
    """--quick: `values` for the options the command line left at their defaults."""
    if not args.quick:
        return
    for key, value in values.items():
        if getattr(args, key) == ap.get_default(key):
            setattr(args, key, value)
