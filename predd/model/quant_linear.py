"""Projections that read the checkpoint's own quantised blocks at decode's few rows.

A decode step of a few calls reads every weight of the model for a few rows of
arithmetic: it is bound by memory. When predd serves a GGUF file whose projections are
Q4_1 or Q8_0 blocks (SmolLM2-135M's are: 4.5 and 8.5 bits a weight), a float32 copy
of them is 4.7-7x the bytes. `QuantLinear` keeps the blocks beside the packed float32
weight and, for inputs of up to `QUANT_ROWS` rows, computes from the blocks
(predd/kernels/csrc/quant_linear.c, through predd/kernels/cpu_kernels.py): the same weights to the bit
(the loader's dequantisation, never fused), float32 arithmetic, the sum in another
order. Longer inputs (prefill) take the packed float32 GEMM, where arithmetic, not
memory, is the limit.

In a bfloat16 model on a CPU with bf16 dot products the blocks' weights are rounded to
bf16 and multiplied as bf16 (`BF16_NATIVE_ROWS`, below): the same weights and products
as the model's packed bf16 GEMM, from a quarter of its bytes. Where the CPU also has
AMX-BF16 tiles, 2 rows or more are multiplied by them, each block unpacked once for up
to 96 rows (`Kernels.bf16_tiles`): there the blocks beat the dense GEMM up to ~100 rows.
Without AMX, Q4_1 blocks are held with 16 weight rows across the lanes
(`Kernels.bf16_lanes`, predd/kernels/csrc/quant_lanes.c) and multiplied as the exact weights
d q + m (bf16 rows, float32 sums), not bf16-rounded ones. A CPU with AVX2 and FMA but
no bf16 dot products makes the same products by float32 FMAs (`Kernels.bf16_dots`).

In float32 the blocks beat the packed GEMM up to 24 rows and lose beyond (measured:
docs/kernels.md, "Float32 rows from the blocks up to 24 rows").
"""
from __future__ import annotations

import functools
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from predd.model import calibration
from predd.model.loader import QuantBlocks
from predd.model.llama import FUSED

# Up to how many rows a model of each dtype computes from the blocks. In bfloat16 the
# rows are widened to float32 and the result rounded back, and the packed bf16 GEMM it
# competes with reads 2 bytes a weight, not 4, so the blocks pay only at the fewest
# rows (measured: docs/kernels.md, "Widened bfloat16 rows from the blocks up to 4 rows").
QUANT_ROWS = {torch.float32: 24, torch.bfloat16: 4}
# bfloat16 rows where the CPU has bf16 dot products, or AVX2 and FMA to make the same
# products (`Kernels.bf16_blocks`), take another kernel: each weight rounded to bf16 as
# the bf16 model holds it, bf16 products summed in float32: these pay up to 12 calls a
# step (measured: docs/kernels.md, "bf16 dot products from the blocks up to 12 rows").
BF16_NATIVE_ROWS = 12
# Both limits above were measured on one machine each; where the dense GEMM is faster
# (oneDNN's AMX tiles can beat these kernels at 8 bf16 rows: docs/kernels.md, "Row
# limits calibrated at start-up"), predd measures its own (`calibrate`) at start-up,
# trying these row counts in turn until the blocks lose.
CALIBRATION_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


# The int8 kernels' rows, by call (`CallRows`): a call of up to this many new tokens (a
# decode, a short chunk) takes the int8 blocks, a longer one the dense weight, where a
# GEMM pays. All of SmolLM2-135M's decoder projections, 2 AVX2 Zen 3 vCPUs, int8 / dense
# ms: 32 rows 93 / 99, 64 rows 201 / 163, 128 rows 414 / 258 (measured: docs/kernels.md,
# "Long calls on the dense weight beside int8 rows"). The same count as the row kernel's
# (`CpuAttention.KERNEL_ROWS`), so a step of calls no longer than both runs in C.
INT8_CALL_ROWS = 64


@dataclass
class CallRows:
    """A step's rows by call, for the int8 projections (`QuantLinear.forward`): each
    call's rows take the kernel its own length chooses, so a row's result never depends
    on the other calls of its step. `rows` the step's (0: no split this step); `long`
    the [start, end) of each call of more than INT8_CALL_ROWS rows (the dense weight);
    `short` every other row, as runs [start, end) of adjacent calls (the int8 blocks).
    `together`: the long calls' rows in one GEMM (`long_runs`, their runs), where the
    dense weight gives a row the same bits whatever rows come with it (`independent_rows`:
    measured at start); else one GEMM a call. Rows go by runs, not index tensors: a run
    is a view of x and a plain copy into y (measured: docs/kernels.md, "Long calls on the
    dense weight beside int8 rows")."""
    rows: int = 0
    long: list[tuple[int, int]] = field(default_factory=list)
    short: list[tuple[int, int]] = field(default_factory=list)
    long_runs: list[tuple[int, int]] | None = None
    together: bool = False

    def plan(self, qo_indptr: np.ndarray) -> None:
        """The split for a step whose calls' rows start at `qo_indptr` ([calls + 1])."""
        starts, ends = qo_indptr[:-1].tolist(), qo_indptr[1:].tolist()
        self.long = [(s, e) for s, e in zip(starts, ends) if e - s > INT8_CALL_ROWS]
        self.short, self.long_runs = [], None
        if not self.long:
            self.rows = 0
            return
        self.rows = ends[-1]
        self.short = runs([(s, e) for s, e in zip(starts, ends) if 0 < e - s <= INT8_CALL_ROWS])
        if self.together and len(self.long) > 1:
            self.long_runs = runs(self.long)

    def clear(self) -> None:
        self.rows, self.long, self.short, self.long_runs = 0, [], [], None


def runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` (in order, not overlapping) with each that ends where the next starts
    joined to it."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def rows_of(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """x's rows in `spans`, in order: a view where there is one."""
    if len(spans) == 1:
        return x[spans[0][0]:spans[0][1]]
    return torch.cat([x[s:e] for s, e in spans])


def put_rows(y: torch.Tensor, spans: list[tuple[int, int]], values: torch.Tensor) -> None:
    """y's rows in `spans` = `values`' rows, in order."""
    at = 0
    for start, end in spans:
        y[start:end] = values[at:at + end - start]
        at += end - start


class QuantLinear(nn.Module):
    """`inner` (a PackedLinear or nn.Linear) with its weight's blocks too."""

    limits_set = 0      # how many times any one's `limit` was set (LayerLoop caches by it)
    calls: CallRows | None = None      # a decoder layer's under int8 (`attach`)

    def __init__(self, inner: nn.Module, blocks: QuantBlocks, kernels,
                 dtype: torch.dtype = torch.float32, int8: bool = False) -> None:
        """`int8`: float32 rows are quantised per block to int8 and multiplied by int8
        dot products (predd/kernels/csrc/quant_int8.c, llama.cpp's arithmetic), not by the
        blocks' exact float32 weights."""
        super().__init__()
        if int8 and dtype != torch.float32:
            raise ValueError("int8 dot products take a float32 model's rows")
        self.int8 = int8
        self.inner = inner
        # in the layout the kernel for the model's `dtype` reads (bfloat16 ones: tiles of
        # rows, predd/kernels/csrc/quant_blocks.h; Q4_1 in lanes without AMX tiles,
        # predd/kernels/csrc/quant_lanes.c), so that one copy is held; predd/kernels/layer_loop.py takes
        # its pointers
        if dtype == torch.bfloat16 and kernels.bf16_blocks:
            lanes = kernels.bf16_lanes and blocks.kind == "Q4_1"
            self.blocks = (blocks.in_lanes() if lanes else blocks.in_tiles()).on_huge_pages()
        elif int8:      # in groups of rows, half-float scales (predd/kernels/csrc/quant_int8.c)
            self.blocks = blocks.in_groups().with_scales(np.float16).on_huge_pages()
        else:
            self.blocks = blocks.in_rows().with_scales(np.float32).on_huge_pages()
        self.out_features = blocks.rows()
        bias = getattr(inner, "bias", None)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.kernels = kernels
        self.limit = None                   # set by calibrate(); else default_limit()

    # each kernel bound on its first call (for rows of the other dtype than the model's,
    # with the blocks converted then)
    @functools.cached_property
    def run(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.kernels.bind(self.blocks, self.bias, int8=self.int8)

    @functools.cached_property
    def run_bf16(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return (self.kernels.bind(self.blocks, self.bias, torch.bfloat16)
                if self.kernels.bf16_blocks else None)

    @property
    def limit(self) -> int | None:
        return self._limit

    @limit.setter
    def limit(self, rows: int | None) -> None:
        self._limit = rows
        QuantLinear.limits_set += 1

    @functools.cached_property
    def run_logits(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return (self.kernels.bind(self.blocks, self.bias, torch.bfloat16, widen=True)
                if self.kernels.bf16_blocks and self.blocks.kind == "Q8_0" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = self.calls
        if calls is not None and calls.rows and calls.rows == x.shape[0]:
            return self.by_call(x, calls)
        return self.from_blocks(x) if self.takes(x) else self.inner(x)

    def by_call(self, x: torch.Tensor, calls: CallRows) -> torch.Tensor:
        """x's rows by `calls`: the short calls' from the blocks, each long call's by the
        dense weight alone."""
        y = x.new_empty(x.shape[0], self.out_features)
        if calls.short:
            put_rows(y, calls.short, self.from_blocks(rows_of(x, calls.short)))
        if calls.long_runs is not None:
            put_rows(y, calls.long_runs, self.inner(rows_of(x, calls.long_runs)))
        else:
            for start, end in calls.long:
                y[start:end] = self.inner(x[start:end])
        return y

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x's rows are computed from the blocks (up to `limit` rows)."""
        limit = self.limit if self.limit is not None else self.default_limit(x.dtype)
        return x.shape[0] <= limit

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) in float32 (a model's head): from bf16 rows and Q8_0 blocks the
        kernel stores the bf16 result widened, the same values without a second pass
        (measured: docs/kernels.md, "Logits widened as they are stored")."""
        if x.dtype == torch.bfloat16 and self.run_logits is not None and self.takes(x):
            return self.run_logits(x.contiguous())
        with torch.inference_mode():        # (a caller outside it: the layer loop's head)
            return self(x).float()

    def default_limit(self, dtype: torch.dtype) -> int:
        """Up to how many rows of `dtype` the blocks are used before `calibrate`."""
        if dtype == torch.bfloat16 and self.run_bf16 is not None:
            return BF16_NATIVE_ROWS
        return QUANT_ROWS.get(dtype, 0)

    def from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x times the blocks' weight, whatever the rows."""
        if x.dtype == torch.bfloat16 and self.run_bf16 is not None:
            return self.run_bf16(x.contiguous())
        if x.dtype == torch.float32:
            return self.run(x.contiguous())
        return self.run(x.float()).to(x.dtype)     # bf16 rows in, float32 arithmetic


def blocks_for(name: str, blocks: dict[str, QuantBlocks], tied: bool) -> QuantBlocks | None:
    """The blocks of the model's projection `name` (a module path of predd.model.llama, fused
    ones included): its Hugging Face weight's, its parts' stacked by rows, the
    embedding's for a tied lm_head; None where any part is missing or kinds differ."""
    if name == "lm_head" and tied:
        return blocks.get("model.embed_tokens.weight")
    for fused, parts in FUSED.items():
        if name.endswith(fused):
            prefix = name[:-len(fused)]
            found = [blocks.get(f"{prefix}{part}.weight") for part in parts]
            if any(b is None for b in found) or len({b.kind for b in found}) != 1:
                return None
            return QuantBlocks(found[0].kind, np.concatenate([b.q for b in found]),
                               np.concatenate([b.d for b in found]),
                               None if found[0].m is None else np.concatenate([b.m for b in found]))
    return blocks.get(f"{name}.weight")


def attach(model: nn.Module, blocks: dict[str, QuantBlocks], kernels, tied: bool,
           dtype: torch.dtype = torch.float32, int8: bool = False) -> int:
    """Wraps every projection of `model` (of `dtype`) whose weight is in `blocks` (with
    the shape the projection has) in a QuantLinear (by int8 dot products: `int8`); the
    count. Under int8 the decoder layers' share one `CallRows` (`call_rows`)."""
    count = 0
    calls = CallRows()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, (nn.Embedding, QuantLinear)) or not hasattr(child, "out_features"):
                continue
            found = blocks_for(name, blocks, tied)
            if found is None or found.rows() != child.out_features \
                    or found.columns() != child.in_features:
                continue
            layer = QuantLinear(child, found, kernels, dtype, int8)
            if int8 and name != "lm_head":          # (the head takes a step's out rows)
                layer.calls = calls
            setattr(parent, child_name, layer)
            count += 1
    return count


def call_rows(model: nn.Module) -> CallRows | None:
    """The split by call its int8 projections share (`attach`), or None; `together` set
    where each of their dense weights gives a row the same bits whatever rows come with
    it (`independent_rows`)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.calls is not None]
    if not layers:
        return None
    calls = layers[0].calls
    shapes = {}
    for m in layers:       # one of each kind of projection (the kernels differ by shape)
        shapes.setdefault((m.inner.in_features, m.out_features), m.inner)
    calls.together = all(independent_rows(inner) for inner in shapes.values())
    return calls


def independent_rows(inner: nn.Module, counts: tuple[int, ...] = (65, 100, 300, 1000)
                     ) -> bool:
    """Whether `inner` (a projection's dense weight) gives rows of float32 the same bits
    in calls of each of `counts` rows, at any offset, as in one call of all of them: then
    several long calls can share one GEMM with no call's result depending on the others
    (oneDNN's packed GEMM does on a 2-core AVX2 Zen 3; a library is free not to)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), inner.in_features, generator=gen)
    with torch.inference_mode():
        whole = inner(x)
        start = 0
        for n in counts:
            if not torch.equal(inner(x[start:start + n]), whole[start:start + n]):
                return False
            start += n
    return True


def group_of(name: str) -> str:
    """The kind of projection a module path names, its last part (`qkv_proj`,
    `gate_up_proj`, `lm_head`, ...): the unit `calibrate` decides for."""
    return name.rsplit(".", 1)[-1]


def calibrate(model: nn.Module, dtype: torch.dtype, reps: int = 3
              ) -> tuple[dict[str, int], str]:
    """Measures on this machine, for each kind of projection of `model` (`group_of`), up
    to how many rows of `dtype` computing it from its blocks beats its dense weight, and
    sets every QuantLinear's `limit` to its kind's: (limit per kind, the timings as
    `rows: blocks/dense ms a step` over all projections). A measurement is one pass over
    all the projections in the model's order, as a decode step reads them (so no weight
    is still in cache when it comes round again), each projection timed on its own and
    summed over its kind, best of `reps`. Kinds differ: a Q8_0 head has more to unpack
    per byte than Q4_1 layers, and a big weight streams where a small one waits."""
    layers = [(group_of(name), m) for name, m in model.named_modules()
              if isinstance(m, QuantLinear)]
    if not layers:
        return {}, "no projection has blocks"
    gen = torch.Generator().manual_seed(0)
    widths = {m.blocks.columns() for _, m in layers}
    clock = time.perf_counter

    def measure(rows: int) -> dict[str, tuple[float, float]]:
        xs = {w: torch.randn(rows, w, generator=gen).to(dtype) for w in widths}
        best: dict[str, list[float]] = {g: [float("inf")] * 2 for g, _ in layers}
        for _ in range(reps):                # the paths in turn: a burst of others' work
            for path in (0, 1):              # slows both alike (0: blocks, 1: dense)
                spent = dict.fromkeys(best, 0.0)
                for group, m in layers:
                    x = xs[m.blocks.columns()]
                    t0 = clock()
                    m.inner(x) if path else m.from_blocks(x)
                    spent[group] += clock() - t0
                for group, t in spent.items():
                    best[group][path] = min(best[group][path], t)
        return {g: (b, d) for g, (b, d) in best.items()}
    # the decoder layers' kinds as one too: a step runs its layers in one C call only
    # where every one of them is computed from its blocks (predd/kernels/layer_loop.py), which
    # saves more a step than a kind's blocks lose by near its limit (measured:
    # docs/kernels.md, "A step's layers in one C call")
    together = frozenset(group_of(name) for name, m in model.named_modules()
                         if isinstance(m, QuantLinear) and ".layers." in name)
    with torch.inference_mode():
        limits, seen = choose_limits(measure, together=together)
    for group, m in layers:
        m.limit = limits[group]
    return limits, ", ".join(
        f"{rows}: {sum(b for b, _ in t.values()) * 1e3:.1f}/"
        f"{sum(d for _, d in t.values()) * 1e3:.1f}" for rows, t in seen)


def calibrated(model: nn.Module, dtype: torch.dtype) -> tuple[dict[str, int], str]:
    """`calibrate`'s limits, measured once per machine and model shape and then read
    from the cache (predd/model/calibration.py), so that every start computes the same sums;
    (limit per kind, where they came from and the timings)."""
    layers = [(group_of(name), m) for name, m in model.named_modules()
              if isinstance(m, QuantLinear)]
    if not layers:
        return {}, "no projection has blocks"
    shapes = Counter((group, m.blocks.kind, m.blocks.rows(), m.blocks.columns(), m.int8,
                      m.blocks.lanes) for group, m in layers)
    key = calibration.key_of({**calibration.machine(), "dtype": str(dtype),
                              "rows": CALIBRATION_ROWS, "projections": sorted(
                                  [*shape, count] for shape, count in shapes.items())})
    record, problem = calibration.load(key)
    stored = True
    if not _valid(record, {group for group, _ in layers}):
        contention = calibration.Contention()
        limits, timings = calibrate(model, dtype)
        fresh = {"limits": limits, "timings": timings, "others": contention.share()}
        record, where = calibration.store(key, fresh)
        if not _valid(record, set(limits)):           # another's, unreadable
            record, where = fresh, f"not stored: {where}"
        stored = not where.startswith("not stored")
        how = f"measured, {where}"
    else:
        how = (f"measured {record.get('measured', '?')}, from "
               f"{calibration.directory() / (key + '.json')}")
    for note in (problem, calibration.contended(record.get("others"), stored)):
        if note:
            how += f"; {note}"
    for group, m in layers:
        m.limit = record["limits"][group]
    return dict(record["limits"]), f"{how}; rows: blocks/dense ms a step: {record['timings']}"


def _valid(record: dict | None, groups: set[str]) -> bool:
    limits = record.get("limits") if record else None
    return (isinstance(limits, dict) and set(limits) == groups
            and all(type(v) is int and v >= 0 for v in limits.values())
            and isinstance(record.get("timings"), str))


def describe_limits(limits: dict[str, int]) -> str:
    """`<= 8 rows` where every kind has the same limit, else each kind's."""
    if len(set(limits.values())) == 1:
        return f"<= {next(iter(limits.values()))} rows"
    return "<= " + ", ".join(f"{rows} rows ({group})" for group, rows in limits.items())


EVERY_ROW = sys.maxsize      # a limit no step reaches: the blocks at every row count


def set_limit(model: nn.Module, rows: int) -> None:
    """Every QuantLinear of `model` computes from its blocks up to `rows` rows."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.limit = rows


def choose_limits(measure: Callable[[int], dict[str, tuple[float, float]]],
                  candidates: tuple[int, ...] = CALIBRATION_ROWS,
                  together: frozenset[str] = frozenset()
                  ) -> tuple[dict[str, int], list[tuple[int, dict[str, tuple[float, float]]]]]:
    """({kind: the most rows of `candidates`, taken in order, at which `measure(rows)`
    -> {kind: (blocks seconds, dense seconds)} favoured the kind's blocks before they
    first lost, 0 if at once}, what was measured). A tie goes to the dense weight.
    The kinds of `together` are also taken as one: up to the rows at which their
    blocks' times summed beat their dense times summed (before that first lost), each
    of them takes its blocks even where it alone would not. Stops measuring once every
    kind, and `together`, has lost."""
    limits: dict[str, int] = {}
    racing: set[str] | None = None
    joint, joined = 0, bool(together)
    seen = []
    for rows in candidates:
        times = measure(rows)
        seen.append((rows, times))
        if racing is None:
            racing = set(times)
            limits = dict.fromkeys(times, 0)
        for group in sorted(racing):
            blocks, dense = times[group]
            if blocks >= dense:
                racing.discard(group)
            else:
                limits[group] = rows
        if joined:
            blocks, dense = (sum(times[g][i] for g in together if g in times) for i in (0, 1))
            if blocks >= dense:
                joined = False
            else:
                joint = rows
        if not racing and not joined:
            break
    for group in together & set(limits):
        limits[group] = max(limits[group], joint)
    return limits, seen
