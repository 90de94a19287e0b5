"""The runner: the model, the paged KV tensor and the attention backend.

`execute(chunks)` runs one forward pass over the chunks of a step (one per call) and
returns the float32 logits each chunk asked for. It knows nothing of sessions or
objects: the engine hands it, per call, token ids, positions and a page table (the
pages that hold the call's entries, in order) with the number of entries it attends
to; the step's tables go to the attention backend as one `PageTables`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from predd.engine.chunk import Chunk
from predd.kernels import cpu_kernels
from predd.worker import cuda_graphs
from predd.kernels import layer_loop
from predd.model import linear
from predd.model import quant_linear
from predd.worker import tp as tp_mod
from predd.attention.backends import make_backend, resolve as resolve_attention
from predd.worker.paged_kv import PagedKVCache
from predd.model.dtype import DTYPES
from predd.model.loader import load_weights, quantized_blocks
from predd.model.llama import LlamaModel
from predd.attention.page_table import PageTables



@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"    # resolved: predd.model.dtype turns `auto` into one of DTYPES
    dtype_reason: str = ""
    dtype_auto: bool = False  # `--dtype auto` chose it (int8 dot products may follow)
    kv_pages: int = 4096
    page_size: int = 16
    attention: str = "torch"  # a predd.attention.backends.CHOICES name; `auto` is resolved at start
    threads: int = 0          # torch intra-op threads on CPU; 0 keeps torch's default
    linear: str = "auto"      # a LINEAR_CHOICES name: quantized, else packed, where they run
    quant_rows: int | None = None   # blocks up to this many rows; None: measured at start
    cuda_graphs: str = "auto"       # a cuda_graphs.CHOICES name
    max_batch: int = 64             # the most calls a step carries (the largest graph)
    layer_loop: bool = True         # a step's layers in one C call where it can (CPU)
    cascade: bool = True            # forks' shared pages attended once, in blocks (CPU)
    kv_dtype: str = "auto"          # a KV_DTYPE_CHOICES name (`Runner.kv_dtype`)


@dataclass
class Launch:
    """A forward pass started (`Runner.launch`): its logits where the model ran, the rows
    of each chunk, and on a GPU the event recorded after its kernels."""
    logits: torch.Tensor
    rows: list[int]
    done: torch.cuda.Event | None = None

    def ready(self) -> bool:
        """Whether the pass is done (never blocks). A device-side error says done: it is
        raised again where the pass lands (`Runner.land`), which fails its calls."""
        try:
            return self.done is None or self.done.query()
        except Exception:
            return True


LINEAR_CHOICES = ("auto", "plain", "packed", "quantized", "int8")
KV_DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the tensor parallel ranks, and its link to them."""
    world: int
    rank: int
    link: tp_mod.Link


class Runner:
    def __init__(self, config: RunnerConfig,
                 progress: Callable[[str], None] = lambda msg: None,
                 tp: TensorParallel | None = None) -> None:
        """With `tp`, this rank's part of the model and of the KV pool (predd/worker/tp.py);
        `model_config` stays the whole model's, and on rank 0 `cache` is the pool of
        every rank as one (`tp.ShardedCache`)."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.tp = tp
        if config.threads:
            torch.set_num_threads(config.threads)
        started = time.monotonic()
        # refused before the model loads
        attention, _ = resolve_attention(config.attention, config.device, config.dtype)
        self.kv_dtype, self.kv_dtype_reason = self._kv_dtype(config.kv_dtype, attention)
        self.model_config, weights = load_weights(
            config.model_path, self.dtype, progress,
            tp_mod.part_of(tp.world, tp.rank) if tp else None)
        full = self.model_config
        self.layout = tp_mod.layout(full, tp.world, tp.rank) if tp else None
        local = tp_mod.local_config(full, self.layout) if tp else full
        self.model = LlamaModel(local, tp.link.all_reduce if tp else None).to(self.dtype)
        self.model.load(weights)
        self.model.to(self.device).eval()
        self.model.inv_freq = self.model.inv_freq.float()
        del weights
        # int8: a step's long calls by the dense weight (quant_linear.CallRows; `_pack`)
        self.call_rows: quant_linear.CallRows | None = None
        self.linear, self.linear_reason = self._pack(config.linear)
        graphs, self.graphs_reason = cuda_graphs.resolve(config.cuda_graphs, config.device,
                                                         attention, tp is not None)
        pool = PagedKVCache(local, config.kv_pages, config.page_size, self.kv_dtype,
                            self.device, spare_pages=1 if graphs else 0)
        self.backend = make_backend(attention, pool)
        if self.backend.name == "cpu":     # its kernels do the layers' small ops too
            self.model.ops = cpu_kernels.CpuOps(cpu_kernels.kernels())
        self.graphs = self._record(config, pool, progress) if graphs else None
        self.layer_loop_reason = (layer_loop.problem(self.model, self.backend, self.dtype,
                                                     tp is not None)
                                  if config.layer_loop else "off (asked for)")
        self.layer_loop = (layer_loop.LayerLoop(self.model, pool, self.backend)
                           if self.layer_loop_reason is None else None)
        self.cascade_reason = self._cascade_problem(config.cascade)
        if self.backend.name == "cpu":    # (the kernels also check dtype and tiles a step)
            self.backend.kernel.shared_prefix = config.cascade
        self.cache = pool
        if tp and tp.rank == 0:
            self.cache = tp_mod.ShardedCache(
                pool, tp.link, [tp_mod.layout(full, tp.world, r) for r in range(tp.world)], full)
        where = f" (tensor parallel rank {tp.rank} of {tp.world})" if tp else ""
        progress(f"model {full.name} ready on {config.device}{where} ({config.dtype}: "
                 f"{config.dtype_reason or 'asked for'}; attention {self.backend.name}; "
                 f"linear {self.linear}: {self.linear_reason}{self._graphs_note()}"
                 f"{self._layer_loop_note()}) "
                 f"in {time.monotonic() - started:.1f}s; KV pool {config.kv_pages} pages "
                 f"x {config.page_size} = {pool.kv.nbytes / 2**20:.0f} MiB "
                 f"({str(self.kv_dtype)[6:]}: {self.kv_dtype_reason})")

    def _kv_dtype(self, requested: str, attention: str) -> tuple[torch.dtype, str]:
        """(the KV pool's dtype, why) for `--kv-dtype requested`: the model's, or bfloat16
        for a float32 model on the CPU, whose attention widens each value as it reads it
        (half the bytes a step's attention reads; measured: docs/kernels.md, "A bfloat16
        pool for float32 models"). `auto` takes bfloat16 where `--dtype auto` chose
        float32 on a CPU and predd's own attention kernel runs, else the model's dtype.
        ValueError (EINVAL) for any other pair."""
        if requested not in KV_DTYPE_CHOICES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, "
                             f"not {requested!r} (EINVAL)")
        mixed = self.dtype == torch.float32 and self.device.type == "cpu"
        if requested == "auto":
            if self._auto_float32 and attention == "cpu":
                return torch.bfloat16, ("auto: a float32 model on the CPU, its attention "
                                        "reading bfloat16 entries")
            return self.dtype, "auto: the model's dtype"
        kv = DTYPES[requested]
        if kv == self.dtype:
            return kv, "asked for"
        if kv == torch.bfloat16 and mixed:
            return kv, "asked for"
        raise ValueError(f"--kv-dtype {requested}: the pool holds the model's dtype "
                         f"({str(self.dtype)[6:]}), or bfloat16 under a float32 model on "
                         f"the CPU (EINVAL)")

    def _pack(self, requested: str) -> tuple[str, str]:
        """(`int8`, `quantized`, `packed` or `plain`, why) for `--linear requested`: packs
        the model's projections (predd/model/linear.py) and gives them their checkpoint's blocks
        (predd/model/quant_linear.py) where chosen. `auto` takes the most that runs here:
        `int8` where `--dtype auto` chose float32 on a CPU with AVX2 (`_int8`), else
        `quantized`, else `packed`. ValueError (EINVAL) when
        `packed`, `quantized` or `int8` is asked for and cannot run."""
        if requested not in LINEAR_CHOICES:
            raise ValueError(f"--linear must be one of {', '.join(LINEAR_CHOICES)}, "
                             f"not {requested!r} (EINVAL)")
        if self.config.quant_rows is not None and self.config.quant_rows < 0:
            raise ValueError(f"--quant-rows must be 0 or more, not {self.config.quant_rows} "
                             f"(EINVAL)")
        if requested == "int8" and self.dtype != torch.float32:
            raise ValueError("--linear int8: the int8 dot products take a float32 model, "
                             f"not {str(self.dtype)[6:]} (EINVAL)")
        if requested == "plain":
            return "plain", "asked for"
        why = "asked for" if requested != "auto" else "auto"
        # the blocks need no packing: where oneDNN cannot pack this dtype (bf16 on an
        # AVX2 CPU), rows beyond the blocks' limit take the plain dense weight
        unpackable = linear.packing_problem(self.device, self.dtype)
        if unpackable and requested == "packed":
            raise ValueError(f"--linear packed: {unpackable} (EINVAL)")
        packed = (f"not packed: {unpackable}" if unpackable else
                  f"{linear.pack_linears(self.model)} projections packed for oneDNN")
        if requested == "packed":
            return "packed", f"{why}: {packed}"
        int8, int8_why = self._int8(requested)
        problem, count = self._quantize(int8)
        if problem:
            if requested in ("quantized", "int8"):
                raise ValueError(f"--linear {requested}: {problem} (EINVAL)")
            return (("plain", f"auto: {unpackable}; not quantized: {problem}") if unpackable
                    else ("packed", f"{why}: {packed}; not quantized: {problem}"))
        rows = self.config.quant_rows
        if int8:
            # by call, not measured: the int8 kernels every row of a call of up to
            # INT8_CALL_ROWS, the dense weight a longer call's (`call_rows`), so a row's
            # result is its own whatever shares its step, where a limit on the step's
            # rows would make it depend on them (measured: docs/kernels.md, "Long calls
            # on the dense weight beside int8 rows")
            if rows is not None:
                raise ValueError("--quant-rows applies to --linear quantized: int8 dot "
                                 "products take calls by their own length (EINVAL)")
            quant_linear.set_limit(self.model, quant_linear.EVERY_ROW)
            upto = f"calls of up to {quant_linear.INT8_CALL_ROWS} rows"
            self.call_rows = quant_linear.call_rows(self.model)
            gemm = ("in one GEMM (a row's bits the same whatever its rows)"
                    if self.call_rows.together else "one GEMM a call")
            how = (f"longer calls by the dense weight, {gemm}; a row's result its own, "
                   f"whatever its step")
        elif rows is None:
            limits, how = quant_linear.calibrated(self.model, self.dtype)
            upto = quant_linear.describe_limits(limits)
        else:
            quant_linear.set_limit(self.model, rows)
            upto, how = f"<= {rows} rows", "--quant-rows"
        kernels = cpu_kernels.kernels()
        tiles = "" if self.dtype != torch.bfloat16 else (
            " (bf16 rows by AMX tiles)" if kernels.bf16_tiles else
            " (bf16 rows by float32 FMAs)" if kernels.bf16_dots == "fma" else "")
        if int8:
            return "int8", (f"{why}: {packed}, {count} of them computed from the "
                            f"checkpoint's Q4_1/Q8_0 blocks by int8 dot products "
                            f"({cpu_kernels.kernels().int8_dots}; {int8_why}) at {upto} ({how})")
        return "quantized", (f"{why}: {packed}, {count} of them computed from the "
                             f"checkpoint's Q4_1/Q8_0 blocks{tiles} at {upto} ({how})")

    @property
    def _auto_float32(self) -> bool:
        """Whether `--dtype auto` chose float32 on a CPU (no bf16 arithmetic there): where
        `auto` takes int8 dot products and a bfloat16 pool; a float32 model asked for by
        name keeps exact weights and entries."""
        return self.config.dtype_auto and self.dtype == torch.float32 \
            and self.device.type == "cpu"

    def _int8(self, requested: str) -> tuple[bool, str]:
        """(whether the blocks take int8 dot products, why): asked for, or under `auto`
        where `--dtype auto` chose float32 (a CPU without bf16 arithmetic) and the
        kernels have AVX2's integer dot products: the arithmetic llama.cpp uses on such a
        CPU (x quantised per block of 32, ~0.4% of a block's largest value). A float32
        model asked for by name keeps float32 rows times the blocks' exact weights, as
        `--linear quantized` does."""
        if requested == "int8":         # (a float32 model: `_pack`)
            return True, "asked for"
        if requested != "auto" or not self._auto_float32 or cpu_kernels.problem() \
                or cpu_kernels.kernels().int8_dots == "portable":
            return False, ""
        return True, "--dtype auto chose float32; --dtype float32 keeps float32 rows"

    def _graphs_note(self) -> str:
        """How decode steps run, for the start-up line (on a GPU; the CPU has none)."""
        if self.device.type != "cuda":
            return ""
        return f"; CUDA graphs {'on' if self.graphs else 'off'}: {self.graphs_reason}"

    def _cascade_problem(self, asked: bool) -> str | None:
        """Why calls' shared prefixes are not attended together in blocks
        (predd.kernels.library.SharedPrefixes), or None where they are."""
        if not asked:
            return "off (asked for)"
        if self.backend.name != "cpu":
            return f"the attention backend is {self.backend.name}, not cpu"
        if self.dtype != torch.bfloat16:
            return f"it runs in bfloat16, the model is {str(self.dtype)[6:]}"
        if self.backend.kernel.attention_blocks is None:
            return "the CPU has neither AMX tiles nor bf16 dot products"
        return None

    def _layer_loop_note(self) -> str:
        """Whether steps run their layers in one C call, for the start-up line (CPU)."""
        if self.device.type != "cpu":
            return ""
        return (("; layers in one C call" if self.layer_loop
                 else f"; layers from Python: {self.layer_loop_reason}")
                + (f"; shared prefixes in blocks ({self.backend.kernel.attention_blocks})"
                   if self.cascade_reason is None else ""))

    def _record(self, config: RunnerConfig, pool: PagedKVCache,
                progress: Callable[[str], None]) -> cuda_graphs.DecodeGraphs | None:
        """The decode step's CUDA graphs; None (eager steps, the reason kept) where
        recording fails under `auto`; ValueError (EINVAL) where it fails under `on`."""
        try:
            return cuda_graphs.DecodeGraphs(self.model, pool, self.backend.graph_wrapper,
                                            config.max_batch, cuda_graphs.cuda_capture(
                                                self.device), progress)
        except Exception as exc:
            try:       # a device-side error leaves the device unusable: predd stops
                torch.cuda.synchronize(self.device)
            except Exception:
                raise exc from None
            what = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            if config.cuda_graphs == "on":
                raise ValueError(f"--cuda-graphs on: not recorded: {what} (EINVAL)") from exc
            self.graphs_reason = f"auto: not recorded ({what}); steps run eagerly"
            return None

    def _quantize(self, int8: bool = False) -> tuple[str | None, int]:
        """(why not, how many): the packed projections given their GGUF blocks (to be
        multiplied by int8 dot products: `int8`)."""
        if self.tp:
            return "not under tensor parallelism", 0
        if self.dtype not in quant_linear.QUANT_ROWS:
            return "the block kernels serve float32 and bfloat16 models", 0
        problem = cpu_kernels.problem()
        if problem:
            return f"CPU kernels unavailable: {problem}", 0
        blocks = quantized_blocks(self.config.model_path, self.model_config)
        count = quant_linear.attach(self.model, blocks, cpu_kernels.kernels(),
                                    self.model_config.tie_word_embeddings, self.dtype, int8)
        if not count:
            return "the checkpoint has no Q4_1 or Q8_0 projections", 0
        return None, count

    def execute(self, chunks: list[Chunk], host: bool = True) -> list[torch.Tensor]:
        """One forward pass; per chunk a [len(outputs), vocab] float32 tensor, on the CPU
        (`host`), else where the model ran: the engine picks a step's tokens there and
        brings to the host only the ids and what else it needs (predd/engine/outputs.py,
        `to_host`). Under tensor parallelism the other ranks are sent the step first."""
        return self.land(self.launch(chunks), host)

    def launch(self, chunks: list[Chunk]) -> Launch:
        """`execute`'s first half: the pass started. On a GPU the kernels are queued and
        run after this returns (`Launch.ready` says when they are done); on a CPU the
        pass is done when it returns."""
        if self.tp:
            self.tp.link.send(tp_mod.STEP, tp_mod.encode_chunks(chunks))
        logits = self.compute(chunks, logits=True)
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return Launch(logits, [len(c.outputs) for c in chunks], done)

    def land(self, launch: Launch, host: bool = True) -> list[torch.Tensor]:
        """`execute`'s second half: each chunk's rows once the pass is done, as `execute`
        gives them. A device-side error is raised here."""
        logits = launch.logits.cpu() if host else self._done(launch.logits)
        result, at = [], 0
        for k in launch.rows:
            result.append(logits[at:at + k])
            at += k
        return result

    def compute(self, chunks: list[Chunk], logits: bool = False) -> torch.Tensor:
        """The forward pass itself: the wanted rows' logits (none unless `logits`: a
        rank other than 0 only takes its part in the all-reduces), where the model ran."""
        tables = PageTables.build(self.config.page_size, [c.pages for c in chunks],
                                  [c.kv_len for c in chunks], [len(c.tokens) for c in chunks])
        tokens = np.concatenate([c.tokens for c in chunks]).astype(np.int64)
        positions = np.concatenate([c.positions for c in chunks]).astype(np.int64)
        out_rows = np.array([row + start for c, start in zip(chunks, tables.qo_indptr.tolist())
                             for row in c.outputs.tolist()] if logits else [], dtype=np.int64)
        if self.graphs and logits:
            out = self.graphs.run(tables, tokens, positions, out_rows)
            if out is not None:
                return out
        dev = self.device
        tokens_t, positions_t = torch.from_numpy(tokens).to(dev), torch.from_numpy(positions).to(dev)
        out_rows_t = torch.from_numpy(out_rows).to(dev)
        if self.layer_loop:
            out = self.layer_loop.run(tables, tokens_t, positions_t, out_rows_t)
            if out is not None:
                return out
        if self.call_rows is None:
            return self.model(tokens_t, positions_t, self.backend.prepare(tables), out_rows_t)
        self.call_rows.plan(tables.qo_indptr)   # int8: long calls on the dense weight
        try:
            return self.model(tokens_t, positions_t, self.backend.prepare(tables), out_rows_t)
        finally:
            self.call_rows.clear()

    def _done(self, out: torch.Tensor) -> torch.Tensor:
        """`out` once the device has computed it (a CUDA step's kernels run after the
        launch returns): the step's time is the forward's, and a device-side error is
        raised here, in the step that made it (core.Engine._execute isolates it)."""
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return out

    def keepalive(self) -> None:
        """Called by the server when idle: under tensor parallelism rank 0 pings the
        other ranks now and then, so that they can tell a silent rank 0 from a dead one."""
        if self.tp:
            self.tp.link.keepalive()

    def stop(self) -> None:
        """Rank 0: tell the other ranks to exit."""
        if self.tp:
            self.tp.link.send(tp_mod.STOP)
