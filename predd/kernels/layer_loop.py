"""A step's decoder layers in one C call (predd/kernels/csrc/layer_loop.c) where every piece of
the step runs on predd's own CPU kernels.

`LlamaModel.forward` drives each layer from Python: ~10 kernel calls a layer, each
through a module call, ctypes and a fresh torch tensor. At a decode step of a few calls
that loop is a large part of the step, and the other threads wait for it (measured:
docs/kernels.md, "A step's layers in one C call").
`LayerLoop.run` hands the whole loop to C instead: the same kernels with the same
arguments in the same order (the same bits out), the step's buffers made once, the
layers' weights' pointers taken once at start.

It takes a step only where the Python loop would call exactly these kernels: float32,
or bfloat16 with the bf16 block kernels; the `cpu` attention backend and its ops; one
rank; every projection from its blocks at this step's rows (`QuantLinear`'s limit);
every call on the attention kernels (up to `CpuAttention.KERNEL_ROWS` new tokens).
Anything else (a long prefill, a projection past its limit) takes the Python loop.
`Runner.layer_loop_reason` says why it is off where it is.
"""
from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from predd.kernels import library
from predd.kernels.bindings import INT8, LANES, Layer, Prefixes, Projection, Step
from predd.attention.backends import CpuAttention
from predd.model.llama import LlamaModel, every_row
from predd.attention.page_table import PageTables
from predd.worker.paged_kv import PagedKVCache
from predd.model import quant_linear
from predd.model.quant_linear import QuantLinear

KINDS = {"Q4_1": 4, "Q8_0": 8}


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")   # in Layer's order


def _projections(layer) -> tuple:
    """A decoder layer's projections, in `PROJECTIONS` order."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _projection(m: QuantLinear) -> Projection:
    b = m.blocks               # in the layout of the model's dtype's kernels
    # the C kernels take the scales untyped: half floats for int8, else float32
    scale = np.float16 if m.int8 else np.float32
    assert b.d.dtype == scale and (b.m is None or b.m.dtype == scale), \
        f"{b.kind} blocks with {b.d.dtype} scales for the {scale.__name__} kernels"
    return Projection(LANES if b.lanes else KINDS[b.kind] + (INT8 if m.int8 else 0),
                      b.columns(), b.rows(),
                      b.q.ctypes.data, b.d.ctypes.data,
                      None if b.m is None else b.m.ctypes.data,
                      None if m.bias is None else m.bias.data_ptr())


def problem(model: LlamaModel, backend, dtype: torch.dtype, tp: bool) -> str | None:
    """Why the layers cannot run in one C call here, or None."""
    if backend.name != "cpu":
        return f"the attention backend is {backend.name}, not cpu"
    if dtype not in library.SUFFIX:
        return f"it runs float32 and bfloat16 models, this one is {str(dtype)[6:]}"
    if tp:
        return "tensor parallel: the layers' outputs are all-reduced between the kernels"
    pool = backend.cache.dtype
    if pool != dtype and (dtype, pool) != (torch.float32, torch.bfloat16):
        return f"no kernels for a {str(dtype)[6:]} model over a {str(pool)[6:]} pool"
    if dtype == torch.bfloat16 and not backend.kernel.bf16_blocks:
        return "the CPU has no bf16 dot products for the block kernels"
    for i, layer in enumerate(model.model.layers):
        for name, m in zip(PROJECTIONS, _projections(layer)):
            if not isinstance(m, QuantLinear) or m.blocks.kind not in KINDS:
                return (f"layer {i}'s {name} is not computed from Q4_1 or Q8_0 blocks "
                        "(--linear quantized)")
    if model.model.norm.eps != model.cfg.rms_norm_eps:      # run_layers ends with it
        return "the final norm's eps is not the layers'"
    return None


class LayerLoop:
    """`run` a step's layers in C; built once per runner (the weights' pointers)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, backend: CpuAttention) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.kernels = backend.kernel
        cfg = model.cfg
        layers = model.model.layers
        self.quant = [m for layer in layers for m in _projections(layer)]
        # the most new tokens a call of a step it takes may have: the row kernel's, and
        # under int8 the blocks' (a longer call takes the dense weight: CallRows)
        int8 = any(m.calls is not None for m in self.quant)
        self.call_limit = (min(backend.KERNEL_ROWS, quant_linear.INT8_CALL_ROWS) if int8
                           else backend.KERNEL_ROWS)
        self._limits = (-1, 0)      # (QuantLinear.limits_set then, rows_limit)
        pool = cache.kv          # [layers, ...]: one tensor, made once with the cache
        self.layers = (Layer * len(layers))(*(
            Layer(layer.input_layernorm.weight.data_ptr(),
                  layer.post_attention_layernorm.weight.data_ptr(),
                  *(_projection(m) for m in _projections(layer)), pool[i].data_ptr())
            for i, layer in enumerate(layers)))
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                      cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps
        self.final_norm = model.model.norm.weight.data_ptr()   # (its eps: `problem`)
        self.dtype = layers[0].input_layernorm.weight.dtype
        suffix = library.SUFFIX[self.dtype]
        if cache.dtype != self.dtype:       # float32 rows over a bfloat16 pool (`problem`)
            suffix += "_kv" + library.SUFFIX[cache.dtype]
        self.run_layers = getattr(self.kernels._lib, f"run_layers_{suffix}")
        self._plan = self.kernels._lib.plan_step
        self._out = np.zeros(4, np.int64)    # plan_step's counts
        self._cap = 0                        # rows and calls plan_step's arrays hold
        self._addresses: list[int] = []
        self._buffers: tuple[np.ndarray, np.ndarray] | None = None
        self._rows: dict[str, torch.Tensor] = {}    # delta, h, qkv, attn, gate_up, act
        self._rows_at: list[int] = []

    def _work(self, rows: int) -> tuple[list[int], int]:
        """The addresses of plan_step's 16 arrays of `_cap` int64 (predd/kernels/csrc/
        step_plan.c) and of the shared prefixes' prior, for steps of up to `rows` rows and
        calls, and the layers' buffers of as many rows (`_rows`, their addresses in
        Step's order `_rows_at`): made again only when a step has more."""
        if rows > self._cap:
            self._cap = max(rows, 2 * self._cap)
            heads, kv_heads, head_dim, hidden, inter = self.shape
            self._buffers = (np.empty((16, self._cap), np.int64),
                             np.empty((self._cap, heads, head_dim + 2), np.float32))
            self._addresses = [row.ctypes.data for row in self._buffers[0]]
            self._rows = {name: torch.empty(self._cap, width, dtype=self.dtype)
                          for name, width in (
                              ("delta", hidden), ("h", hidden),
                              ("qkv", (heads + 2 * kv_heads) * head_dim),
                              ("attn", heads * head_dim), ("gate_up", 2 * inter),
                              ("act", inter))}
            self._rows_at = [b.data_ptr() for b in self._rows.values()]
        return self._addresses, self._buffers[1].ctypes.data

    def takes(self, tables: PageTables) -> bool:
        """Whether the Python loop would call exactly the kernels `run` calls (a longer
        call takes SDPA, and under int8 the dense weight: QuantLinear.by_call)."""
        return (bool(len(tables)) and int(tables.q_len.max()) <= self.call_limit
                and int(tables.qo_indptr[-1]) <= self.rows_limit())

    def rows_limit(self) -> int:
        """The most rows every projection computes from its blocks (their limits, read
        again only once one is set: reading them every step costs time; measured:
        docs/kernels.md, "A step's layers in one C call")."""
        if self._limits[0] != QuantLinear.limits_set:
            self._limits = (QuantLinear.limits_set, min(
                (m.limit if m.limit is not None else m.default_limit(self.dtype)
                 for m in self.quant), default=sys.maxsize))
        return self._limits[1]

    def run(self, tables: PageTables, tokens: torch.Tensor, positions: torch.Tensor,
            out_rows: torch.Tensor) -> torch.Tensor | None:
        """The step's logits as `LlamaModel.forward` returns them, or None (nothing
        done) where `takes` says no. (No autograd to turn off: every op here is a
        kernel of tensors that need no gradient; the head's torch fallback turns it off
        itself.)"""
        if not self.takes(tables):
            return None
        heads, kv_heads, head_dim, hidden, inter = self.shape
        page_size = self.cache.page_size
        T = int(tables.qo_indptr[-1])
        w, prior = self._work(max(T, len(tables)))
        self._plan(len(tables), tables.qo_indptr.ctypes.data, tables.kv_len.ctypes.data,
                   tables.indptr.ctypes.data, tables.indices.ctypes.data, page_size,
                   *self.kernels.plan_limits(), w[0], self._cap, self._out.ctypes.data)
        max_visible, calls, rest, groups = self._out.tolist()
        # the shared prefixes of the row kernel's rows: all rows', or the rest's beside
        # the calls on the blocks (where those fail, so would the prefixes' blocks)
        shared = Prefixes(*w[10:14], groups, w[14], prior) if groups else Prefixes()
        x, (cos, sin) = self.model.embed(tokens, positions)
        step = Step(T, hidden, heads, kv_heads, head_dim, inter, self.cache.page_size,
                    self.eps, head_dim ** -0.5, x.data_ptr(), *self._rows_at,
                    cos.data_ptr(), sin.data_ptr(), w[3], tables.indices.ctypes.data,
                    *w[0:3], max_visible, w[5], w[6], calls, *w[7:10], rest,
                    self.kernels.row_span(T, kv_heads), self.kernels.row_span(rest, kv_heads),
                    *((Prefixes(), shared) if calls else (shared, Prefixes())),
                    self.final_norm)
        if self.run_layers(self.layers, len(self.layers), ctypes.byref(step)) != 0:
            raise MemoryError("the layers could not allocate their scratch buffers (ENOMEM)")
        h = self._rows["h"][:T]           # every row through the final norm (run_layers)
        if not len(out_rows):
            return torch.empty(0, self.model.cfg.vocab_size, dtype=torch.float32)
        return self.model.logits(h if every_row(out_rows, T) else h[out_rows])
