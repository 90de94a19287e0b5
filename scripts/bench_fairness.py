"""Fairness across uids: a well-behaved LIP's per-token latency while another uid floods.

A real predd; a *victim* LIP (its own uid) decodes `--tokens` tokens greedily, by
predd's generate stream and by a client-side pred loop, first alone, then while a
*flooder* LIP running as `nobody` keeps `--flood-threads` pred calls of
`--flood-prompt` tokens in flight; `--repeat` such pairs. The figure is the median over
pairs of loaded/alone of the victim's mean per-token latency (the goal: at most 2);
pairs, not one alone run, because a shared host's speed drifts. The same is measured
with the latency bound off (`--latency-factor 0`: fair order only) as the baseline, in
the same run, with `--baseline-tokens` (its steps are slow). Prints `RESULT {...}`
lines: ratios, the hardware, device and dtype.

    python scripts/bench_fairness.py [--dtype float32] [--tokens 32] [--flood-threads 16]
           [--flood-prompt 512] [--repeat 3] [--baseline-tokens 8] [--device cpu]

Needs root to run the two LIPs as other uids (they import liblip as root, then setuid);
otherwise both run as the caller and the figure is only per-session fairness.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VICTIM_UID = 4242
NOBODY = 65534


def drop_to(uid: int) -> None:
    if os.geteuid() == 0 and uid != os.geteuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


# ---------------------------------------------------------------- the two LIPs

def victim(addr: str, tokens: int) -> None:
    """Per mode, the gaps between tokens (s) as one JSON line; waits for a line on stdin
    before each round, so the bench can start and stop the flood in between."""
    import liblip as lip
    lip.connect(addr, name="victim")
    prompt = lip.tokenize("The quick brown fox jumps over the lazy dog, and then the dog")
    for line in sys.stdin:
        if line.strip() == "quit":
            return
        rounds = {}
        for mode in ("generate", "pred"):
            kv = lip.kv_create()
            stamps = []
            if mode == "generate":
                for _tok in lip.generate_stream(kv, prompt, max_tokens=tokens,
                                                ignore_eos=True):
                    stamps.append(time.perf_counter())
            else:
                step = prompt
                for _ in range(tokens):
                    step = [lip.pred_sample(kv, step, {"temperature": 0.0}).token]
                    stamps.append(time.perf_counter())
            lip.kv_remove(kv)
            rounds[mode] = [b - a for a, b in zip(stamps, stamps[1:])]
        print(json.dumps(rounds), flush=True)


def flooder(addr: str, threads: int, prompt_len: int) -> None:
    """Keep `threads` pred calls of prompt_len tokens in flight until stdin closes;
    print tokens computed and errors by errno."""
    from liblip.client import Client, LipError
    client = Client(addr, name="flooder")
    stop = threading.Event()
    done = [0] * threads
    errors: dict[str, int] = {}

    def run(i: int) -> None:
        kv = client.call("kv_create")["cap"]
        ids = [(7 * i + 13 * j) % 5000 + 100 for j in range(prompt_len)]
        while not stop.is_set():
            try:
                client.call("pred", cap=kv, tokens=ids, outputs=[])
                done[i] += prompt_len
                client.call("kv_truncate", cap=kv, length=0)
            except LipError as exc:
                errors[exc.code] = errors.get(exc.code, 0) + 1
                time.sleep(0.01)

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    print(json.dumps({"flooding": True}), flush=True)
    sys.stdin.read()
    stop.set()
    for w in workers:
        w.join(timeout=60)
    print(json.dumps({"tokens": sum(done), "seconds": time.perf_counter() - t0,
                      "errors": errors}), flush=True)
    client.close()


# ---------------------------------------------------------------- the bench

def spawn(role: str, uid: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role,
                             "--uid", str(uid), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})


def ask(proc: subprocess.Popen, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def measure(args, rundir: str, latency_factor: float, tokens: int, repeat: int) -> dict:
    from predd.server import launch
    daemon = launch.start(os.path.join(rundir, f"f{latency_factor:g}"), "--dtype", args.dtype,
                          "--device", args.device, "--latency-factor", str(latency_factor),
                          "--threads", str(args.threads))
    os.chmod(daemon.rundir, 0o755)
    victim_uid = VICTIM_UID if os.geteuid() == 0 else os.geteuid()
    flood_uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    v = spawn("victim", victim_uid, "--addr", daemon.addr, "--tokens", str(tokens))
    f = None
    pairs: list[tuple[dict, dict]] = []
    floods: list[dict] = []
    try:
        ask(v, "warm-up")
        for _ in range(repeat):
            alone = ask(v, "alone")
            f = spawn("flooder", flood_uid, "--addr", daemon.addr, "--flood-threads",
                      str(args.flood_threads), "--flood-prompt", str(args.flood_prompt))
            json.loads(f.stdout.readline())
            time.sleep(args.settle)
            loaded = ask(v, "loaded")
            f.stdin.close()
            floods.append(json.loads(f.stdout.readline()))
            f.wait(timeout=60)
            pairs.append((alone, loaded))
        v.stdin.write("quit\n")
        v.stdin.flush()
        v.wait(timeout=30)
        from liblip.client import Client
        c = Client(daemon.addr)
        info, stats = c.call("info"), c.call("stats")
        c.close()
    finally:
        for proc in (v, f):
            if proc is not None and proc.poll() is None:
                proc.kill()
        daemon.stop()
    out = {"info": info, "capped_steps": stats["capped_steps"],
           "flood_tokens_per_s": round(sum(x["tokens"] for x in floods)
                                       / sum(x["seconds"] for x in floods), 1),
           "flood_errors": [x["errors"] for x in floods],
           "victim_uid": victim_uid, "flooder_uid": flood_uid}
    for mode in ("generate", "pred"):
        alone_ms = [statistics.fmean(a[mode]) * 1e3 for a, _ in pairs]
        loaded_ms = [statistics.fmean(b[mode]) * 1e3 for _, b in pairs]
        gaps = sorted(g for _, b in pairs for g in b[mode])
        out[mode] = {"ratio": round(statistics.median(b / a for a, b in
                                                      zip(alone_ms, loaded_ms)), 3),
                     "ratios": [round(b / a, 2) for a, b in zip(alone_ms, loaded_ms)],
                     "alone_ms": [round(x, 1) for x in alone_ms],
                     "loaded_ms": [round(x, 1) for x in loaded_ms],
                     "loaded_p90_ms": round(gaps[int(0.9 * (len(gaps) - 1))] * 1e3, 1)}
    print(f"bench: latency factor {latency_factor:g}: " + json.dumps(
        {m: out[m] for m in ("generate", "pred")}) + f", flood {out['flood_tokens_per_s']} "
        f"tokens/s, {out['capped_steps']} capped steps", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="predd's torch CPU threads "
                    "(0: torch's default; 1 is steadier on a busy host)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="alone/loaded pairs")
    ap.add_argument("--baseline-tokens", type=int, default=8,
                    help="tokens per victim run without the latency bound (slow steps)")
    ap.add_argument("--flood-threads", type=int, default=16)
    ap.add_argument("--flood-prompt", type=int, default=512)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of flood before "
                    "the loaded measurement")
    ap.add_argument("--role", choices=["victim", "flooder"], help=argparse.SUPPRESS)
    ap.add_argument("--uid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        import liblip.client  # noqa: F401  (everything is imported before dropping root)
        import liblip.api  # noqa: F401
        drop_to(args.uid)
        if args.role == "victim":
            victim(args.addr, args.tokens)
        else:
            flooder(args.addr, args.flood_threads, args.flood_prompt)
        return 0
    rundir = tempfile.mkdtemp(prefix="symphony-fair-", dir="/tmp")
    os.chmod(rundir, 0o755)
    try:
        bounded = measure(args, rundir, 2.0, args.tokens, args.repeat)
        fair_only = measure(args, rundir, 0.0, args.baseline_tokens, 1)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
    info = bounded["info"]
    hw = f"{platform.machine()} {os.cpu_count()} cpu, {info['device']}"
    for mode in ("generate", "pred"):
        print("RESULT " + json.dumps({
            "bench": f"fairness_{mode}", "metric": "victim_ms_per_token_loaded_over_alone",
            **bounded[mode], "baseline": "latency_factor_0_fair_order_only",
            "baseline_ratio": fair_only[mode]["ratio"],
            "flood_tokens_per_s": bounded["flood_tokens_per_s"],
            "baseline_flood_tokens_per_s": fair_only["flood_tokens_per_s"],
            "capped_steps": bounded["capped_steps"],
            "victim_uid": bounded["victim_uid"], "flooder_uid": bounded["flooder_uid"],
            "tokens": args.tokens, "flood": f"{args.flood_threads}x{args.flood_prompt}",
            "model": info["model"], "dtype": info["dtype"], "hardware": hw,
            "load_average": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
