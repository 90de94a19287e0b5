"""vLLM (CPU build) as a benchmark baseline: offline `LLM.generate` and its OpenAI server.

vLLM lives in its own venv made by `make bench-setup` ($BENCH_DIR/vllm-venv, default
~/.cache/symphony-bench) and loads the model export beside it ($BENCH_DIR/smollm2-135m).
The bench imports this module from the project's venv; the offline run is this same file
run as a subprocess by the vLLM venv's python (`bench_vllm.py offline`, a JSON job on
stdin, a JSON result as the last stdout line), so nothing at module level may import
more than the standard library.

Both are run as fairly as we know how: greedy, `ignore_eos`, prompts given as token
ids, the same dtype as Symphony, a KV budget equal to predd's (`num_gpu_blocks_override`
in vLLM's 128-token CPU blocks), the same step token budget and batch size, no prefix
caching (Symphony's programs start from empty KV objects, and the runs repeat the same
prompts), both cores (vLLM's CPU worker binds one thread per core it is given and
defaults to one), and tcmalloc and Intel's OpenMP preloaded as its CPU worker asks
(where present: bench-setup installs them). Its compile caches live in $BENCH_DIR/cache: the first start compiles
for minutes, later starts reuse them.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

BLOCK_TOKENS = 128          # vLLM's CPU KV block size
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
START_TIMEOUT_S = 1800      # a first start compiles the model graph
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"   # libtcmalloc-minimal4


class Unavailable(Exception):
    """The baseline cannot run here; the message says why, in a few words."""


def bench_dir() -> str:
    return os.environ.get("BENCH_DIR") or os.path.expanduser("~/.cache/symphony-bench")


def locate() -> tuple[str, str]:
    """(the vLLM venv's python, the model export), or Unavailable."""
    root = bench_dir()
    python = os.path.join(root, "vllm-venv", "bin", "python")
    model = os.path.join(root, "smollm2-135m")
    if not os.path.isfile(os.path.join(root, "vllm-venv", ".symphony-bench-stamp")):
        raise Unavailable(f"no vLLM venv in {root} (run `make bench-setup`)")
    if not os.path.isfile(os.path.join(model, ".symphony-bench-stamp")):
        raise Unavailable(f"no model export in {model} (run `make bench-setup`)")
    return python, model


def cpu_env() -> dict[str, str]:
    """Environment for a vLLM process: every core this process may use, cached compiles."""
    cores = sorted(os.sched_getaffinity(0))
    cache = os.path.join(bench_dir(), "cache")
    env = {**os.environ,
           "VLLM_CPU_OMP_THREADS_BIND": core_list(cores),
           "OMP_NUM_THREADS": str(len(cores)),
           "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           # vLLM 0.32's AOT-compiled artifact fails to load back on torch 2.13
           # ("no attribute 'finalize_loading'") and every start compiled anew (~90 s
           # here); the older compile cache loads (a second start: ~25 s).
           "VLLM_USE_AOT_COMPILE": "0",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("PYTHONPATH", None)     # the project's modules are not vLLM's business
    preload = [lib for lib in (TCMALLOC, os.path.join(bench_dir(), "vllm-venv", "lib",
                                                      "libiomp5.so")) if os.path.isfile(lib)]
    if preload:                     # what vLLM's CPU worker asks for, when it is here
        env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
    return env


def core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    spans: list[list[int]] = []
    for c in cores:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def engine_args(model: str, dtype: str, kv_tokens: int, max_seqs: int,
                step_tokens: int, prefix_caching: bool = False,
                block_tokens: int = BLOCK_TOKENS, offload_gib: float | None = None) -> dict:
    """The engine settings both the offline run and the server use (LLM() kwargs).
    The KV budget is given twice: in blocks of `block_tokens`, and in bytes, which also
    spares the CPU worker its default reservation of 92% of the machine's memory.
    (vLLM keeps one of those blocks back as its null block.) `offload_gib`: its native
    KV offloading to host memory (`kv_offloading_size`), where the build has it."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    token_bytes = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]
    blocks = kv_tokens // block_tokens
    args = {"dtype": dtype, "num_gpu_blocks_override": blocks,
            "kv_cache_memory_bytes": blocks * block_tokens * token_bytes,
            "max_num_seqs": max_seqs, "max_num_batched_tokens": step_tokens,
            "max_model_len": min(kv_tokens - block_tokens, 2048),
            "enable_prefix_caching": prefix_caching, "seed": 0}
    if block_tokens != BLOCK_TOKENS:
        args["block_size"] = block_tokens
    if offload_gib is not None:
        args["kv_offloading_size"] = offload_gib
    return args


# ------------------------------------------------------------------ offline

def offline(jobs: list[list[list[int]]], n_new: int, dtype: str, kv_tokens: int,
            max_seqs: int, step_tokens: int, repeat: int, log=print) -> list[tuple[float, list]]:
    """Per job (a list of prompts as token ids): the best of `repeat` timed
    `LLM.generate` calls over all its prompts at once, and the generated ids."""
    python, model = locate()
    job = {"model": model, "jobs": jobs, "n_new": n_new, "repeat": repeat,
           "engine": engine_args(model, dtype, kv_tokens, max_seqs, step_tokens)}
    log_path = os.path.join(tempfile.mkdtemp(prefix="symphony-vllm-"), "offline.log")
    log(f"bench: vLLM offline (log {log_path}) ...")
    with tempfile.TemporaryFile("w+") as out, open(log_path, "w") as vlog:
        proc = subprocess.Popen([python, os.path.abspath(__file__), "offline"],
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.PIPE,
                                text=True, env=cpu_env())
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        tail: list[str] = []
        for line in proc.stderr:              # vLLM's own log to the file; ours shown too
            vlog.write(line)
            vlog.flush()
            tail = (tail + [line.rstrip()])[-30:]
            if line.startswith("bench:"):
                log(line.rstrip())
        if proc.wait() != 0:
            raise Unavailable(f"vLLM offline run exited {proc.returncode} (log {log_path}):"
                              "\n  " + "\n  ".join(tail))
        out.seek(0)
        result = json.loads(out.read().strip().splitlines()[-1])
    return [(min(r["times"]), r["outputs"]) for r in result]


def _offline_worker() -> None:
    """In the vLLM venv: run the job on stdin, print one JSON line."""
    job = json.load(sys.stdin)
    result = os.fdopen(os.dup(1), "w")      # vLLM logs to stdout: send that to stderr
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=job["n_new"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = []
    for prompts in job["jobs"]:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(inputs[:4], warm, use_tqdm=False)
        times = []
        for _ in range(job["repeat"]):
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        print(f"bench: vllm offline, {len(prompts)} prompts: "
              + " ".join(f"{t:.2f}s" for t in times), file=sys.stderr, flush=True)
        results.append({"times": times, "outputs": [list(o.outputs[0].token_ids) for o in outs]})
    print(json.dumps(results), file=result, flush=True)


# ------------------------------------------------------------------ server

class Server:
    """vLLM's OpenAI server on a free loopback port, started and stopped by this process."""

    def __init__(self, dtype: str, kv_tokens: int, max_seqs: int, step_tokens: int,
                 log=print, **engine) -> None:
        """`engine`: more of engine_args' keywords (prefix_caching, block_tokens,
        offload_gib). The server runs in vLLM's dev mode, for reset_prefix_cache()."""
        python, model = locate()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        engine = engine_args(model, dtype, kv_tokens, max_seqs, step_tokens, **engine)
        # Not the `vllm serve` CLI: it asks for the "vllm" distribution's version, and
        # this one is installed as "vllm-cpu".
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "m",
                "--enable-prefix-caching" if engine.pop("enable_prefix_caching")
                else "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
        for key, value in engine.items():
            args += ["--" + key.replace("_", "-"), str(value)]
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="symphony-vllm-"), "serve.log")
        log(f"bench: vLLM OpenAI server (log {self.log_path}) ...")
        self.proc = subprocess.Popen(args, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT,
                                     env={**cpu_env(), "VLLM_SERVER_DEV_MODE": "1"},
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log_path, errors="replace") as f:
                    text = f.read()
                raise Unavailable(f"vLLM's server did not come up (exit {self.proc.returncode})"
                                  f"{root_cause(text)}; log {self.log_path}\n"
                                  f"{text[-3000:]}")
            time.sleep(2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (a cold start for the next run)."""
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 200:
                raise Unavailable(f"reset_prefix_cache answered {r.status}")

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges (`vllm:` names, labels dropped, summed)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name, _, value = line.rpartition(" ")
                name = name.split("{")[0]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return out

    @contextlib.contextmanager
    def paused(self):
        """The server's processes stopped (SIGSTOP) for a `with` block, continued after:
        idle between requests it still polls for seconds after its last one, which took
        CPU from the system measured next (measured: docs/kernels.md, "vLLM's server
        paused between runs")."""
        self._signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        """`sig` to the server's process group, unless it is gone (its failure is then
        reported where it is next used)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)                 # a paused server cannot exit
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def root_cause(log_text: str) -> str:
    """': <the first exception line>' of a vLLM log, or ''."""
    for line in log_text.splitlines():
        line = line.split("] ", 1)[-1].strip()
        if line.startswith(("Exception: ", "ValueError: ", "RuntimeError: ", "NotImplementedError: ")):
            return f": {line}"
    return ""


def completion_request(prompt: list[int], n_new: int) -> dict:
    """A /v1/completions body: token-id prompt, greedy, exactly n_new tokens."""
    return {"model": "m", "prompt": prompt, "max_tokens": n_new, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def completion_ids(reply: dict) -> list[int]:
    return list(reply["choices"][0].get("token_ids") or [])


def warm(dtype: str = "auto") -> None:
    """One tiny offline run: proves vLLM starts here and fills the compile cache (for
    the dtype the bench will use: `auto` is predd's choice for this machine)."""
    if dtype == "auto":
        from predd.model.dtype import resolve
        dtype, _ = resolve("auto", "cpu")
    prompts = [[1, 504, 2365, 6354, 16438], [1, 9690, 42, 253, 1789]]
    (_, outs), = offline([prompts], 8, dtype, 16384, 64, 2048, 1)
    if [len(o) for o in outs] != [8, 8]:
        raise Unavailable(f"vLLM returned {[len(o) for o in outs]} tokens, not [8, 8]")


if __name__ == "__main__":
    if sys.argv[1:] == ["offline"]:      # in the vLLM venv, run by offline()
        _offline_worker()
    elif sys.argv[1:2] == ["warm"]:      # from bench-setup, in the project's venv
        try:
            warm(*sys.argv[2:3])
        except Unavailable as e:
            sys.exit(f"vLLM does not run: {e}")
    else:
        sys.exit("usage: bench_vllm.py warm [DTYPE] | offline < job.json")
