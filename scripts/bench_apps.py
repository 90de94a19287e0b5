"""What the application benchmarks share (B5 agent, B8 Graph-of-Thought, B9 SWARM): one
application written twice and run closed-loop over the same seeded tasks with the same
KV memory.

  symphony   --agents LIP processes (`python BENCH.py lip FILE...`, one task at a time
             each, tasks as JSON lines on stdin: `serve_jobs`), over cache files that
             were prefilled once on a private kvfsd mount (`SymphonyRig`)
  vllm       vLLM's OpenAI server with automatic prefix caching on (its default); the
             application is a client thread per agent that sends, each call, the token
             ids its prompt needs (`VllmRig.complete`)
  vllm_nocache  the same server with prefix caching off

vLLM's servers run first, one at a time, while predd is started and idle; then
Symphony. `report` prints RESULT lines `<bench>_latency` (mean seconds per task; ratio
= vLLM / Symphony) and `<bench>_throughput` (tasks/s; ratio = Symphony / vLLM).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
import liblip as lip  # noqa: E402
from scripts import bench_vllm  # noqa: E402
from scripts.bench_common import Mount, log, percentile, result, start_predd  # noqa: E402
from scripts.rag_workload import WORDS, Run, closed_loop  # noqa: E402

PAGE = 16                     # predd's page, in tokens
VLLM_BLOCK = 32               # the smallest block vLLM's CPU attention takes
GREEDY = {"temperature": 0.0}
TIMEOUT_S = 900
SYSTEMS = ("symphony", "vllm", "vllm_nocache")


# ------------------------------------------------------------------ workloads

def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def at_least(make: Callable[[int], list[int]], target: int) -> list[int]:
    """make(n) (tokens of a text of n words) for the fewest n that make `target`."""
    n = 1
    while len(toks := make(n)) < target:
        n += 1
    return toks


def seeded_text(tokenizer, template: str, seed: float, target: int) -> list[int]:
    """The tokens of `template` with `{}` filled by the fewest seeded words that make
    at least `target` tokens."""
    return at_least(lambda n: tokenizer.encode(template.format(
        words(random.Random(seed), n))), target)


def kv_tokens_for(agents: int, longest: int, shared: Sequence[int] = ()) -> int:
    """KV memory for `agents` tasks of at most `longest` tokens each and the `shared`
    prompts every task uses, in whole vLLM blocks: no side evicts or preempts, with or
    without sharing."""
    return sum(-(-n // VLLM_BLOCK) * VLLM_BLOCK for n in [longest] * agents + list(shared))


def vllm_blocks(kv_tokens: int) -> int:
    return kv_tokens // VLLM_BLOCK + 1                  # and one for its null block


def fields_of(cls, source):
    """A `cls` dataclass from the same-named entries of `source`: a LIP's JSON job (a
    dict) or the bench's argparse namespace."""
    get = source.get if isinstance(source, dict) else lambda k: getattr(source, k)
    return cls(**{f.name: get(f.name) for f in dataclasses.fields(cls)})


def generated(out: Sequence[int], n: int) -> list[int]:
    """`out` as a list, or EIO when a call made other than exactly `n` tokens."""
    if len(out) != n:
        raise lip.LipError("EIO", f"generate returned {len(out)} tokens, not {n}")
    return list(out)


# ------------------------------------------------------------------ Symphony

def serve_jobs(run: Callable[[dict], dict], ready: dict) -> None:
    """A LIP's loop: print `ready`, then answer each JSON job on stdin with one JSON
    line (an errno-named error as {"error", "message"})."""
    print(json.dumps({"ready": ready}), flush=True)
    for line in sys.stdin:
        try:
            reply = run(json.loads(line))
        except lip.LipError as exc:
            reply = {"error": exc.code, "message": str(exc)}
        print(json.dumps(reply), flush=True)


class LipPool:
    """`count` LIP processes (`python script lip *argv`); a job goes to whichever is
    free."""

    def __init__(self, script: str, argv: list[str], count: int, env: dict) -> None:
        from predd.server.launch import die_with_parent
        self.procs: list[subprocess.Popen] = []
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        try:
            for _ in range(count):
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(script), "lip", *argv],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                    cwd=ROOT, preexec_fn=die_with_parent))
            for proc in self.procs:
                ready = json.loads(proc.stdout.readline() or "{}")
                if "ready" not in ready:
                    raise RuntimeError(f"a LIP did not start (exit {proc.poll()})")
                self.free.put(proc)
        except BaseException:
            self.close()
            raise

    def submit(self, job: dict) -> dict:
        proc = self.free.get(timeout=TIMEOUT_S)
        try:
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        finally:
            self.free.put(proc)
        if not line:
            raise RuntimeError(f"a LIP exited {proc.poll()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{reply['error']}: {reply.get('message')}")
        return reply

    def close(self) -> None:
        """End of input: each LIP frees its handles and exits (else it is stopped)."""
        from predd.server.launch import terminate
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if terminate(proc, 10.0) != 0:
                log(f"bench: a LIP exited {proc.returncode}")
            proc.stdout.close()


class SymphonyRig:
    """predd with `kv_tokens` of KV memory, kvfsd on a private mount, each of `files`
    (name -> tokens) prefilled once into `name.kv` there, and --agents LIPs of `script`
    given those paths."""

    def __init__(self, args, script: str, files: dict[str, list[int]],
                 kv_tokens: int) -> None:
        self.args = args
        self.pages = -(-kv_tokens // PAGE)
        self.daemon = start_predd("--dtype", args.dtype, "--kv-pages", str(self.pages),
                                  "--max-step-tokens", str(args.step_tokens))
        self.mount = self.pool = None
        try:
            self.mount = Mount(self.daemon.addr)
            lip.connect(self.daemon.addr)
            paths = []
            for name, tokens in files.items():
                paths.append(os.path.join(self.mount.path, f"{name}.kv"))
                kv = lip.kv_create()
                cost = lip.prefill(kv, tokens)
                lip.kv_save(kv, paths[-1])
                lip.kv_close(kv)
                log(f"bench: symphony: {name} prefilled once ({cost['computed']} tokens) "
                    f"into {paths[-1]}")
            env = {**os.environ, "PREDD_ADDR": self.daemon.addr,
                   "KVFS_MOUNT": self.mount.path,
                   "PYTHONPATH": os.path.dirname(os.path.dirname(lip.__file__))}
            self.pool = LipPool(script, paths, args.agents, env)
        except BaseException:
            self.close()
            raise

    def run(self, jobs: list[dict]) -> Run:
        before = lip.stats()
        run = closed_loop(jobs, self.args.agents, self.pool.submit)
        after = lip.stats()
        steps = after["steps"] - before["steps"]
        log(f"bench: symphony, {len(jobs)} tasks: {run.seconds:.1f}s, "
            f"{run.rate():.3f} tasks/s, {latencies(run)}; "
            f"{sum(r['computed'] for r in run.replies) / len(jobs):.0f} tokens computed "
            f"and {sum(r['reused'] for r in run.replies) / len(jobs):.0f} reused a task; "
            f"predd {steps} steps, mean batch "
            f"{(after['calls'] - before['calls']) / max(steps, 1):.1f}, step "
            f"{(after['step_ms'] - before['step_ms']) / max(steps, 1):.0f} ms")
        return run

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        with contextlib.suppress(Exception):
            lip.client().close()
        if self.mount is not None:
            self.mount.close()
        self.daemon.stop()


# ------------------------------------------------------------------ vLLM

class VllmRig:
    """vLLM's OpenAI server with `kv_tokens` of KV memory and --agents sequences; each
    client thread keeps one connection."""

    def __init__(self, args, kv_tokens: int, prefix_caching: bool) -> None:
        self.args, self.prefix_caching = args, prefix_caching
        self.blocks = vllm_blocks(kv_tokens)
        self.server = bench_vllm.Server(args.dtype, self.blocks * VLLM_BLOCK,
                                        args.agents * getattr(args, "fanout", 1),
                                        args.step_tokens, log=log,
                                        prefix_caching=prefix_caching,
                                        block_tokens=VLLM_BLOCK)
        self.local = threading.local()

    def complete_many(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """One /v1/completions request for every prompt (greedy, exactly `n` new tokens
        each): the ids, in the prompts' order."""
        import httpx
        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client(base_url=self.server.url, timeout=TIMEOUT_S)
        body = bench_vllm.completion_request(prompts[0] if len(prompts) == 1 else prompts,
                                             n)
        reply = self.local.client.post("/v1/completions", json=body)
        reply.raise_for_status()
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        outs = [list(c.get("token_ids") or []) for c in choices]
        if [len(o) for o in outs] != [n] * len(prompts):
            raise RuntimeError(f"vLLM returned {[len(o) for o in outs]} ids, not "
                               f"{n} for each of {len(prompts)} prompts")
        return outs

    def complete(self, prompt: list[int], n: int) -> list[int]:
        return self.complete_many([prompt], n)[0]

    def run(self, tasks: list, submit: Callable) -> tuple[Run, float]:
        """(the timed run, the prompt tokens it computed per task: those sent that
        vLLM's prefix cache did not hold)."""
        before = self.server.metrics()
        run = closed_loop(tasks, self.args.agents, submit)
        after = self.server.metrics()
        hits = after.get("vllm:prefix_cache_hits_total", 0) - \
            before.get("vllm:prefix_cache_hits_total", 0)
        sent = sum(r["sent"] for r in run.replies)
        log(f"bench: {self.name()} ({self.blocks} blocks), {len(tasks)} tasks: "
            f"{run.seconds:.1f}s, {run.rate():.3f} tasks/s, {latencies(run)}; prompt "
            f"tokens sent {sent}, found in its prefix cache {hits:.0f}")
        return run, (sent - hits) / len(tasks)

    def name(self) -> str:
        return "vllm" if self.prefix_caching else "vllm_nocache"

    def close(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------ run and report

def latencies(run: Run) -> str:
    return (f"mean {sum(run.latencies) / len(run.latencies):.2f}s p50 "
            f"{percentile(run.latencies, 50):.2f}s p99 {percentile(run.latencies, 99):.2f}s")


def measure(args, symphony: Callable[[], SymphonyRig], job: Callable[[object], dict],
            client: Callable[[VllmRig, object], dict], warmup: list, timed: list,
            kv_tokens: int) -> dict:
    """system -> (Run, extra) for each system of args.systems that ran: vLLM's servers
    one at a time while predd idles (neither takes CPU from the other), warm-up tasks
    untimed first; `job(task)` is the task as a LIP's JSON job, `client(rig, task)`
    runs it against vLLM."""
    out: dict = {}
    with contextlib.ExitStack() as stack:
        rig = stack.enter_context(contextlib.closing(symphony())) \
            if "symphony" in args.systems else None
        for name in [s for s in args.systems if s.startswith("vllm")]:
            try:
                base = VllmRig(args, kv_tokens, prefix_caching=name == "vllm")
            except bench_vllm.Unavailable as e:
                log(f"bench: vLLM baseline unavailable: {str(e).splitlines()[0]}")
                break
            try:
                def submit(task, base=base):
                    return client(base, task)
                closed_loop(warmup, args.agents, submit)
                out[name] = base.run(timed, submit)
            except Exception as e:      # noqa: BLE001 - the bench goes on without it
                log(f"bench: {name} failed: {e}; going on without it "
                    f"(log {base.server.log_path})")
            finally:
                base.close()
        if rig is not None:
            closed_loop([job(t) for t in warmup], args.agents, rig.pool.submit)
            out["symphony"] = (rig.run([job(t) for t in timed]), None)
    return out


def summary(run: Run) -> dict:
    return {"mean_s": sum(run.latencies) / len(run.latencies),
            "p50_s": round(percentile(run.latencies, 50), 3),
            "p99_s": round(percentile(run.latencies, 99), 3)}


def report(bench: str, measured: dict, kv_tokens: int, common: dict,
           same: Callable[[Run, Run], str] | None = None) -> None:
    """RESULT lines `<bench>_latency` and `<bench>_throughput` against each vLLM
    system that ran (or against none). `same(ours, theirs)` says how many tokens
    agree (default: whole tasks with equal outputs)."""
    if "symphony" not in measured:
        return
    run, _ = measured["symphony"]
    ours = summary(run)
    mine = {"symphony_p50_s": ours["p50_s"], "symphony_p99_s": ours["p99_s"],
            "symphony_computed_per_task": round(
                sum(r["computed"] for r in run.replies) / len(run.replies), 1)}
    common = {**common, "kv_tokens": kv_tokens}
    baselines = {"vllm": "vllm_prefix_caching", "vllm_nocache": "vllm_no_prefix_caching"}
    for name, label in baselines.items():
        if name not in measured:
            continue
        base, computed = measured[name]
        theirs = summary(base)
        agree = same(run, base) if same else \
            f"{sum(a == b for a, b in zip(run.outputs, base.outputs))}/{len(run.outputs)}"
        extra = {**mine, "baseline_p50_s": theirs["p50_s"], "baseline_p99_s": theirs["p99_s"],
                 "baseline_computed_prompt_per_task": round(computed, 1),
                 "vllm_blocks": vllm_blocks(kv_tokens), "vllm_block_tokens": VLLM_BLOCK,
                 "same_tokens_as_baseline": agree, **common}
        result(f"{bench}_latency", "seconds_per_task", ours["mean_s"], label,
               theirs["mean_s"], ratio=round(theirs["mean_s"] / ours["mean_s"], 3),
               ratio_is="baseline / symphony", **extra)
        result(f"{bench}_throughput", "tasks_per_s", run.rate(), label, base.rate(),
               ratio_is="symphony / baseline", **extra)
    if not any(name in measured for name in baselines):
        result(f"{bench}_latency", "seconds_per_task", ours["mean_s"], "none", 0.0,
               **mine, **common)
        result(f"{bench}_throughput", "tasks_per_s", run.rate(), "none", 0.0, **mine,
               **common)


def app_flags(ap, unit: str) -> None:
    """--agents (8 at once), --tasks (16 timed), --warmup (8 untimed first), --systems."""
    ap.add_argument("--agents", type=int, default=8, help=f"concurrent {unit}")
    ap.add_argument("--tasks", type=int, default=16, help="timed tasks")
    ap.add_argument("--warmup", type=int, default=8, help="untimed tasks first")
    ap.add_argument("--systems", default="symphony,vllm", help=f"of {','.join(SYSTEMS)}")


def entry(lip_main: Callable[..., None], main: Callable[[], int]) -> None:
    """`BENCH.py lip ARGS...` is a LIP of the bench; otherwise the bench itself."""
    if sys.argv[1:2] == ["lip"]:
        lip_main(*sys.argv[2:])
    else:
        sys.exit(main())


def parse_systems(ap, args) -> None:
    args.systems = args.systems.split(",")
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"bad --systems: {args.systems}")
