"""The OpenAI API under load from a client of ours: --num-prompts completions of
--input-len random token ids and --output-len tokens each (`ignore_eos`), at most
--concurrency in flight, streamed; median TPOT, mean TTFT, output tokens/s, completed
and failed requests, output tokens.

Two ways in:
* `--url URL`: an OpenAI server's completions API (`symphony serve`, or any other), its
  server-sent events read over HTTP;
* without it: the OpenAI program itself (`python -m openai_lip`) over its JSON lines on
  stdin and stdout, beside a predd started here (`--model`, `--dtype` and
  $SYMPHONY_BENCH_PREDD_ARGS): no gateway, no HTTP and no mount, so it also runs where
  FUSE and the gateway's packages are missing (a GPU machine: scripts/gpu_check.sh loop).
  There `--baseline generate` (the default) also sends the same requests through
  predd's own loop with no program between (liblip's `generate_into` from threads here),
  alternated with the program round by round (`--repeat`; each goes first every other
  round, after a warm-up of both), and gives the ratios: what the OpenAI program costs
  beside predd's loop. (TTFT is the first token for the baseline, the first text for
  the program.)

A request's TTFT runs from its sending to its first non-empty text; its TPOT is
(latency - TTFT) / (output tokens - 1), the output tokens as its `usage` counts them
(vLLM's serving benchmark defines both so). Over HTTP only the standard library is used.

    python scripts/bench_openai.py [--url URL] [--model PATH] [--dtype auto]
        [--num-prompts 64] [--concurrency 32] [--input-len 128] [--output-len 64]
        [--baseline generate|none] [--repeat 1]
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts.bench_common import (DTYPE_CHOICES, JsonLines, changed, log, machine,  # noqa: E402
                                  result)

REQUEST_TIMEOUT_S = 600.0
FIRST_ID, LAST_ID = 1000, 30000     # prompt ids: no special tokens in SmolLM2's vocabulary


@dataclass
class Outcome:
    """One request as the client saw it (seconds from its sending)."""
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    tokens: int = 0
    error: str = ""


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, LAST_ID) for _ in range(length)] for _ in range(n)]


def body(model: str, prompt: list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def read_events(messages: Iterable[dict], clock: Callable[[], float], started: float
                ) -> Outcome:
    """An Outcome from a request's streamed chunks (completions objects, each read at
    `clock()`); the output tokens from the last `usage` seen."""
    first, usage = None, None
    for chunk in messages:
        if chunk.get("usage"):
            usage = chunk["usage"]
        if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
            first = clock() - started
    latency = clock() - started
    if usage is None:
        return Outcome(False, error="no usage in the stream")
    return Outcome(True, first if first is not None else latency, latency,
                   int(usage.get("completion_tokens", 0)))


def summary(outcomes: list[Outcome], duration: float) -> dict:
    """vLLM's serving benchmark's figures, by its definitions."""
    done = [o for o in outcomes if o.ok]
    tpots = [(o.latency - o.ttft) / (o.tokens - 1) for o in done if o.tokens > 1]
    tokens = sum(o.tokens for o in done)
    return {"completed": len(done), "failed": len(outcomes) - len(done),
            "total_output_tokens": tokens, "duration_s": round(duration, 3),
            "output_throughput": tokens / duration if duration > 0 else 0.0,
            "median_tpot_ms": statistics.median(tpots) * 1e3 if tpots else float("nan"),
            "mean_ttft_ms": statistics.fmean(o.ttft for o in done) * 1e3 if done else float("nan"),
            "errors": sorted({o.error for o in outcomes if not o.ok})[:5]}


# ------------------------------------------------------------------ over HTTP

class Http:
    """An OpenAI server's completions API: one connection a request."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.base = parts.path.rstrip("/")
        self.model = self._get("/v1/models")["data"][0]["id"]

    def _get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("GET", self.base + path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def complete(self, request: dict) -> Outcome:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        started = time.perf_counter()
        try:
            conn.request("POST", self.base + "/v1/completions", json.dumps(request),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return Outcome(False, error=f"HTTP {resp.status}: {resp.read()[:200]!r}")
            return read_events(_sse(resp), time.perf_counter, started)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return Outcome(False, error=f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()


def _sse(lines: Iterable[bytes]) -> Iterable[dict]:
    """The JSON objects of `data:` lines, to `[DONE]`."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


# ------------------------------------------------------------------ the program itself

class Program:
    """`python -m openai_lip` beside the predd at `addr`, over its JSON lines: each
    request's lines go to the inbox of its id (scripts/bench_common.py, `JsonLines`)."""

    def __init__(self, addr: str, model_path: str | None) -> None:
        self.cache = tempfile.mkdtemp(prefix="openai-cache-")
        self.lines = JsonLines(
            [sys.executable, "-m", "openai_lip", "--cache-dir", self.cache,
             *(["--model", model_path] if model_path else [])],
            {**os.environ, "PREDD_ADDR": addr})
        self.proc = self.lines.proc
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"the OpenAI program did not start: {ready}")
        self.model = ready["model"]
        self.lines.start()

    def complete(self, request: dict, rid: int) -> Outcome:
        inbox = self.lines.inbox(rid)
        started = time.perf_counter()
        self.lines.send({"id": rid, "op": "completion", "body": request, "scope": "bench"})
        failed: list[str] = []

        def chunks() -> Iterable[dict]:
            while True:
                msg = inbox.get(timeout=REQUEST_TIMEOUT_S)
                if msg.get("status", 200) != 200:
                    failed.append(f"{msg['status']}: {json.dumps(msg.get('body'))[:200]}")
                if "chunk" in msg:
                    yield msg["chunk"]
                if msg.get("gone"):
                    failed.append(f"the OpenAI program exited {msg['code']}")
                if msg.get("done") or msg.get("gone"):
                    return
        try:
            outcome = read_events(chunks(), time.perf_counter, started)
        except queue.Empty:
            outcome = Outcome(False, error=f"no answer in {REQUEST_TIMEOUT_S:g} s")
        finally:
            self.lines.done(rid)
        return Outcome(False, error=failed[0]) if failed else outcome

    def close(self) -> None:
        self.lines.close(10)


class Generate:
    """The same requests through predd's own loop with no program between: liblip's
    `generate_into` from threads of this process (one a request in flight), every token
    asked, sampled at temperature 1 as the OpenAI program samples a request that sets
    none. What the OpenAI program adds to it is the figure (`--baseline generate`)."""

    def __init__(self, addr: str) -> None:
        import liblip
        self.lip = liblip
        liblip.connect(addr)

    def complete(self, request: dict, rid: int) -> Outcome:
        lip = self.lip
        started = time.perf_counter()
        first, got = 0.0, 0

        def on_tokens(ids: list, _logprobs: list) -> None:
            nonlocal first, got
            if ids and not got:
                first = time.perf_counter() - started
            got += len(ids)
        kv = None
        try:
            kv = lip.kv_create()
            lip.generate_into(kv, request["prompt"], on_tokens, request["max_tokens"],
                              stop=[], sample={"temperature": 1.0, "top_p": 1.0, "seed": rid})
        except lip.LipError as exc:
            return Outcome(False, error=f"{exc.code}: {exc}")
        finally:
            if kv is not None:
                try:
                    lip.kv_close(kv)
                except lip.LipError:
                    pass
        return Outcome(True, first, time.perf_counter() - started, got)

    def close(self) -> None:
        self.lip.client().close()


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU so far (Linux /proc), 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def predd_stats(addr: str) -> dict:
    """predd's `stats`, on a connection of its own (liblip's process-wide one may be
    serving the generate baseline)."""
    from liblip.client import Client
    client = Client(addr)
    try:
        return client.call("stats")
    finally:
        client.close()


def split(before: dict, after: dict) -> str:
    """predd's steps between two `stats`: how many, their mean batch, and its time a
    step by phase (`time_ms`: ms of wall, the CPU ones of its thread)."""
    steps = max(after["steps"] - before["steps"], 1)
    calls = after["calls"] - before["calls"]
    return (f"{steps} steps, mean batch {calls / steps:.1f}; ms a step: "
            f"{changed(before, after, 'time_ms', steps)}")


# ------------------------------------------------------------------ the load

def run(complete: Callable[[dict, int], Outcome], model: str, args, seed: int = 0) -> dict:
    """--num-prompts requests, --concurrency at a time; the summary. Each `seed` makes
    other prompts (a round of its own, no prefix a round before left cached)."""
    todo: queue.Queue = queue.Queue()
    for i, prompt in enumerate(prompts(args.num_prompts, args.input_len, seed)):
        todo.put((i, body(model, prompt, args.output_len)))
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                i, request = todo.get_nowait()
            except queue.Empty:
                return
            outcome = complete(request, i)
            with lock:
                outcomes.append(outcome)

    started = time.perf_counter()
    workers = [threading.Thread(target=worker) for _ in range(min(args.concurrency,
                                                                   args.num_prompts))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return summary(outcomes, time.perf_counter() - started)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an OpenAI server (default: the OpenAI program itself, "
                    "beside a predd started here)")
    ap.add_argument("--model", help="the GGUF predd serves (without --url; default "
                    "SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--baseline", choices=("generate", "none"), default="generate",
                    help="without --url: also the same requests through predd's own loop "
                    "(liblip generate from threads here), alternated, and the ratios")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (each its own prompts)")
    args = ap.parse_args()
    daemon = program = baseline = None
    rounds: list[tuple[dict, dict | None]] = []
    try:
        if args.url:
            client = Http(args.url)
            complete, model, way = (lambda req, _i: client.complete(req)), client.model, args.url
        else:
            from scripts.bench_common import start_predd
            from scripts.bench_completion import KV_PAGES, PAGE_SIZE, STEP_TOKENS
            daemon = start_predd(*(["--model", args.model] if args.model else []),
                                 "--dtype", machine(args.dtype), "--kv-pages", str(KV_PAGES),
                                 "--page-size", str(PAGE_SIZE), "--max-batch", "64",
                                 "--max-step-tokens", str(STEP_TOKENS))
            program = Program(daemon.addr, args.model)
            complete, model, way = program.complete, program.model, "the OpenAI program"
            if args.baseline == "generate":
                baseline = Generate(daemon.addr)
        if baseline is not None:      # both warm (predd's first steps, the program's)
            warm = argparse.Namespace(**{**vars(args), "num_prompts": min(
                args.num_prompts, args.concurrency)})
            run(complete, model, warm, seed=-1)
            run(baseline.complete, model, warm, seed=-1)

        def measured(r: int, name: str, complete_one, pid: int | None) -> dict:
            """One round of one side; `pid`: the process whose CPU a token to log."""
            before = predd_stats(daemon.addr) if daemon is not None else None
            cpu = cpu_seconds(pid) if pid is not None else 0.0
            figures = run(complete_one, model, args, seed=r)
            if daemon is not None:
                mine = ""
                if pid is not None and figures["total_output_tokens"]:
                    used = cpu_seconds(pid) - cpu
                    mine = (f"; the program's CPU "
                            f"{used * 1e6 / figures['total_output_tokens']:.0f} µs a token")
                log(f"bench: round {r + 1}, {name}: predd "
                    f"{split(before, predd_stats(daemon.addr))}{mine}")
            report(name, args, figures)
            return figures
        sides = [(way, complete, program.proc.pid if program is not None else None)]
        if baseline is not None:
            sides.append(("predd's generate from threads", baseline.complete, None))
        for r in range(args.repeat):     # each side goes first every other round
            got = [measured(r, *side) for side in (sides if r % 2 == 0 else sides[::-1])]
            got = got if r % 2 == 0 else got[::-1]
            rounds.append((got[0], got[1] if len(got) > 1 else None))
    finally:
        if baseline is not None:
            baseline.close()
        if program is not None:
            program.close()
        if daemon is not None:
            daemon.stop()
    extra = {"num_prompts": args.num_prompts, "concurrency": args.concurrency,
             "input_len": args.input_len, "output_len": args.output_len, "rounds": args.repeat,
             "completed": sum(f["completed"] for f, _ in rounds),
             "failed": sum(f["failed"] for f, _ in rounds)}
    result("openai", "output_tokens", sum(f["total_output_tokens"] for f, _ in rounds),
           "asked", args.repeat * args.num_prompts * args.output_len, **extra)
    ours = statistics.median(f["output_throughput"] for f, _ in rounds)
    tpot = statistics.median(f["median_tpot_ms"] for f, _ in rounds)
    ttft = statistics.median(f["mean_ttft_ms"] for f, _ in rounds)
    if baseline is None:
        result("openai", "output_tokens_per_s", ours, "none", 0.0,
               median_tpot_ms=round(tpot, 3), mean_ttft_ms=round(ttft, 3), **extra)
    else:
        def ratio(a: float, b: float) -> float | None:
            return round(a / b, 3) if b and math.isfinite(a) and math.isfinite(b) else None

        def ratios(key: str) -> list[float | None]:
            return [ratio(f[key], g[key]) for f, g in rounds]
        theirs = statistics.median(g["output_throughput"] for _, g in rounds)
        their_tpot = statistics.median(g["median_tpot_ms"] for _, g in rounds)
        result("openai", "output_tokens_per_s", ours, "generate", theirs,
               ratio=ratio(ours, theirs), round_ratios=ratios("output_throughput"), **extra)
        result("openai", "median_tpot_ms", tpot, "generate", their_tpot,
               ratio=ratio(tpot, their_tpot), ratio_is="openai / generate (lower is better)",
               round_ratios=ratios("median_tpot_ms"), **extra)
    failed = sum(f["failed"] + (g["failed"] if g else 0) for f, g in rounds)
    return 0 if failed == 0 else 1


def report(way: str, args, figures: dict) -> None:
    log(f"bench: {way}, {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} out, {args.concurrency} in flight: median TPOT "
        f"{figures['median_tpot_ms']:.1f} ms, mean TTFT {figures['mean_ttft_ms']:.0f} ms, "
        f"output {figures['output_throughput']:.1f} tokens/s, {figures['completed']} "
        f"completed, {figures['failed']} failed, {figures['total_output_tokens']} output "
        f"tokens in {figures['duration_s']} s"
        f"{'; ' + str(figures['errors']) if figures['errors'] else ''}")


if __name__ == "__main__":
    sys.exit(main())
