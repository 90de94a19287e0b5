"""The simulation's step costs, measured from a real predd on this machine.

One predd (bench_common.start_predd, predd's default 2048 pages), driven through liblip:
* prefill: one fresh cache of n seeded tokens per n in PREFILL; predd's own step clock
  (`stats.step_ms`) less the fixed step cost, fitted as a*n + b*n^2/2 (per token, and
  per (token, earlier token) pair its attention reads); best of REPEAT below 4096;
* decode: for each context length L in CONTEXTS and batch B in BATCHES, B forks of one
  L-token cache generate DECODE tokens at once (B threads); per step time (step_ms /
  steps, the best of REPEAT) fitted as step_s + d*calls + a*sum of the calls' contexts;
* migration: kv_export of an L-token cache, then kv_import of the blob, timed end to
  end (the same machine, loopback ipc): bytes per token and bytes per second.
Writes the costs (cluster_sim.Costs fields) with the raw points and the machine. The
host is shared: the best of a few runs is the figure least disturbed by the others.
"""
from __future__ import annotations

import json
import random
import threading
import time

import numpy as np

from scripts.bench_common import hardware, load_average, log, machine, start_predd

PREFILL = (256, 1024, 4096)
CONTEXTS = (64, 1024)
BATCHES = (1, 8, 32)
DECODE = 16
REPEAT = 3
MIGRATE = (1024, 4096)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def _busy(lip, work) -> tuple[float, int, int]:
    """(seconds of predd's steps, steps, call-steps) while `work()` runs."""
    before = lip.stats()
    work()
    after = lip.stats()
    return ((after["step_ms"] - before["step_ms"]) / 1e3, after["steps"] - before["steps"],
            after["calls"] - before["calls"])


def _decode(lip, base, batch: int, vocab: int) -> tuple[float, int, int]:
    forks = [lip.kv_fork(base) for _ in range(batch)]
    go = threading.Barrier(batch)

    def one(kv, i: int) -> None:
        go.wait()
        lip.generate(kv, _tokens(1, vocab, i), max_tokens=DECODE, stop=[], ignore_eos=True)

    def work() -> None:
        threads = [threading.Thread(target=one, args=(kv, i)) for i, kv in enumerate(forks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    out = _busy(lip, work)
    for kv in forks:
        lip.kv_close(kv)
    return out


def calibrate(path: str) -> dict:
    dtype = machine()
    daemon = start_predd("--dtype", dtype, "--kv-pages", "2048")
    try:
        import liblip as lip
        lip.connect(daemon.addr)
        vocab = lip.info()["vocab_size"]
        caches, prefill = {}, []
        for n in PREFILL:
            runs = []
            for _ in range(REPEAT if n < 4096 else 1):
                kv = caches.pop(n, None)
                if kv is not None:
                    lip.kv_close(kv)
                kv = caches[n] = lip.kv_create()
                runs.append(_busy(lip, lambda: lip.prefill(kv, _tokens(n, vocab, n))))
            s, steps, _ = min(runs)
            prefill.append({"tokens": n, "seconds": s, "steps": steps})
            log(f"calibrate: prefill {n} tokens: {s:.2f} s in {steps} steps")
        decode = []
        for ctx in CONTEXTS:
            base = caches.get(ctx)
            if base is None:
                base = caches[ctx] = lip.kv_create()
                lip.prefill(base, _tokens(ctx, vocab, ctx))
            for b in BATCHES:
                s, steps, calls = min((_decode(lip, base, b, vocab) for _ in range(REPEAT)),
                                      key=lambda r: r[0] / r[1])
                decode.append({"context": ctx + DECODE // 2, "batch": calls / steps,
                               "step_s": s / steps, "steps": steps})
                log(f"calibrate: decode x{b} at {ctx} tokens: {s / steps * 1e3:.1f} ms a "
                    f"step, mean batch {calls / steps:.1f}")
        migrate = []
        for n in MIGRATE:
            t0 = time.perf_counter()
            blob = lip.kv_export(caches[n])
            t1 = time.perf_counter()
            copy = lip.kv_import(blob)
            t2 = time.perf_counter()
            lip.kv_close(copy)
            migrate.append({"tokens": n, "bytes": len(blob), "export_s": t1 - t0,
                            "import_s": t2 - t1})
            log(f"calibrate: {n} tokens = {len(blob)} bytes: export {t1 - t0:.3f} s, "
                f"import {t2 - t1:.3f} s")
        lip.client().close()
    finally:
        daemon.stop()
    costs = fit(prefill, decode, migrate)
    costs.update(source=f"scripts/simulate_cluster.py --calibrate, {time.strftime('%Y-%m-%d')}"
                 f", {hardware()}, {dtype}, SmolLM2-135M; load average at the end "
                 f"{load_average()} (a shared machine)",
                 points={"prefill": prefill, "decode": decode, "migrate": migrate})
    with open(path, "w") as f:
        json.dump(costs, f, indent=2)
        f.write("\n")
    log(f"calibrate: wrote {path}: " + ", ".join(
        f"{k} {v:.3g}" for k, v in costs.items() if isinstance(v, (int, float))))
    return costs


def fit(prefill: list[dict], decode: list[dict], migrate: list[dict]) -> dict:
    """Least squares, each coefficient at least 0 (a negative one is set to 0 and the
    rest fitted again)."""
    def nonneg(a: np.ndarray, y: np.ndarray) -> np.ndarray:
        keep = list(range(a.shape[1]))
        while True:
            x = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
            if (x >= 0).all():
                out = np.zeros(a.shape[1])
                out[keep] = x
                return out
            keep.pop(int(np.argmin(x)))
    d = np.array([[1.0, p["batch"], p["batch"] * p["context"]] for p in decode])
    step_s, per_call, attend = nonneg(d, np.array([p["step_s"] for p in decode]))
    a = np.array([[p["tokens"], p["tokens"] ** 2 / 2] for p in prefill], dtype=float)
    y = np.array([p["seconds"] - p["steps"] * step_s for p in prefill])
    per_token, pair = nonneg(a, y)
    moved = sum(m["bytes"] for m in migrate)
    return {"step_s": float(step_s), "prefill_s_per_token": float(per_token),
            "prefill_attend_s": float(pair), "decode_s_per_call": float(per_call),
            "attend_s_per_token": float(attend),
            "migrate_bytes_per_s": moved / sum(m["export_s"] + m["import_s"] for m in migrate),
            "kv_bytes_per_token": round(moved / sum(m["tokens"] for m in migrate))}
