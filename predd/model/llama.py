"""A Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over a flattened batch.

The model is a plain module: tokens of all calls in a step are one flat sequence
`[T]`; attention is delegated to a backend prepared for the step (which knows where
every call's entries live in the paged cache). No scheduling, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from predd.model.loader import ModelConfig


class StepAttention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor: ...   # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1 frequency-dependent scaling of long wavelengths.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    """A layer's small ops in plain torch, for every device and dtype: the reference.
    predd/kernels/cpu_kernels.py's `CpuOps` does the same in one pass each (float32 on the
    CPU); `LlamaModel.ops` is one or the other."""

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)); x alone when delta is None."""
        if delta is not None:
            x = x + delta
        return x, norm(x)

    def rotary(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `rope` from the rows' angles [T, D/2]."""
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]           # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def embed(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows `ids` [T] of `weight` [V, C]: a new [T, C] tensor."""
        return F.embedding(ids, weight)

    def rotary_at(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary of the positions' angles (positions [T] int64, inv_freq [D/2])."""
        return self.rotary(positions.float()[:, None] * inv_freq[None, :], dtype)

    def rope(self, qkv: torch.Tensor, heads: int, rotary: tuple[torch.Tensor, torch.Tensor]
             ) -> torch.Tensor:
        """[T, heads, D]: the first `heads` heads of qkv [T, n, D] turned by RoPE."""
        cos, sin = rotary
        qk = qkv[:, :heads]
        return qk * cos + rotate_half(qk) * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's product: silu(gate) * up for gate_up = (gate | up) [T, 2n] -> [T, n]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class Attention(nn.Module):
    """q, k and v come out of one GEMM (`qkv_proj`, fused from Hugging Face's three at
    load) and RoPE turns q and k together: one op each where there were three and two."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (h + 2 * kv) * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.shape = (h, kv, d)

    def forward(self, x: torch.Tensor, rotary, ops: TorchOps, layer: int,
                attend: StepAttention) -> torch.Tensor:
        h, kv, d = self.shape
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, h + 2 * kv, d)
        qk = ops.rope(qkv, h + kv, rotary)
        out = attend(layer, qk[:, :h], qk[:, h:h + kv], qkv[:, h + kv:])   # [T, H, D]
        return self.o_proj(out.reshape(t, h * d))


class MLP(nn.Module):
    """SwiGLU with gate and up in one GEMM (`gate_up_proj`, fused at load)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's per-projection weights with each group of `FUSED` concatenated
    along the output dimension (the order of the tuple), as the model's modules hold
    them; other names pass through. A group must be whole or absent."""
    out = dict(weights)
    for name in weights:
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                if not name.endswith(f".{parts[0]}.{kind}"):
                    continue
                prefix = name[:-len(f"{parts[0]}.{kind}")]
                names = [f"{prefix}{part}.{kind}" for part in parts]
                if any(n not in weights for n in names):
                    raise ValueError(f"weights do not fit the model: {prefix}{fused} needs "
                                     f"all of {', '.join(names)}")
                out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def every_row(rows: torch.Tensor, count: int) -> bool:
    """Whether `rows` (CPU int64) is 0, 1, .., count - 1."""
    if rows.device.type != "cpu" or rows.numel() != count:
        return False
    at = rows.numpy()
    return count == 0 or bool(at[0] == 0 and at[-1] == count - 1
                              and (count < 3 or (at[1:] > at[:-1]).all()))


class LlamaModel(nn.Module):
    """`load` takes Hugging Face's LlamaForCausalLM state dict, names as they are."""

    def __init__(self, cfg: ModelConfig,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`cfg` is this rank's part of the model under tensor parallelism (predd/worker/tp.py:
        its heads and MLP columns); `reduce` sums the attention and MLP outputs over the
        ranks (an all-reduce), nothing on one rank."""
        super().__init__()
        self.cfg = cfg
        self.reduce = reduce or (lambda x: x)
        self.model = Inner(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.ops = TorchOps()

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Loads Hugging Face's names; q/k/v and gate/up are fused here (`fuse`)."""
        if self.cfg.tie_word_embeddings and "lm_head.weight" not in weights:
            weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
        weights = fuse(weights)
        missing, unexpected = self.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: StepAttention, out_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; out_rows: [R] rows whose logits are wanted -> [R, V] fp32."""
        ops = self.ops
        x, rotary = self.embed(input_ids, positions)
        delta = None          # each block's output, added into x by the next norm
        for i, layer in enumerate(self.model.layers):
            x, h = ops.add_norm(x, delta, layer.input_layernorm)
            delta = self.reduce(layer.self_attn(h, rotary, ops, i, attend))
            x, h = ops.add_norm(x, delta, layer.post_attention_layernorm)
            delta = self.reduce(layer.mlp(h, ops))
        return self.head(x, delta, out_rows)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, object]:
        """The layers' input: (the tokens' embeddings [T, C], RoPE's angles for `ops`)."""
        x = self.ops.embed(self.model.embed_tokens.weight, input_ids)
        return x, self.ops.rotary_at(positions, self.inv_freq, x.dtype)

    def head(self, x: torch.Tensor, delta: torch.Tensor, out_rows: torch.Tensor
             ) -> torch.Tensor:
        """The logits [R, V] (float32) of rows `out_rows` of the residual stream x plus
        the last layer's output `delta`."""
        if out_rows.numel() == 0:
            return torch.empty(0, self.cfg.vocab_size, dtype=torch.float32)
        # the wanted rows only, through the layers' own add-and-norm (CpuOps: one kernel
        # call, where torch's RMSNorm took ~10 ops); every row in order (a step of
        # decodes) needs no copies (measured: docs/kernels.md, "The final norm by the
        # layers' add-and-norm")
        if not every_row(out_rows, x.shape[0]):
            x, delta = x[out_rows], delta[out_rows]
        _, h = self.ops.add_norm(x, delta, self.model.norm)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The logits [R, V] (float32) of rows `h` of the final norm's output."""
        logits = getattr(self.lm_head, "logits", None)    # QuantLinear's: float32 at once
        if logits is not None:
            return logits(h)
        with torch.inference_mode():        # (a caller outside it: the layer loop's head)
            return self.lm_head(h).float()
