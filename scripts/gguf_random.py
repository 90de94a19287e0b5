"""Write a Llama-family GGUF of random F16 weights in a chosen shape, with another GGUF's
tokenizer: a model whose step costs what a real one of that shape costs, for timing
where the real weights cannot travel (scripts/gpu_check.sh: a device transfer carries
at most 64 MiB; SmolLM2-1.7B is 3.4 GB). Its tokens are noise. Every block holds the
same random tensors (drawing 1.7 G values would take longer than the timing); the
embedding is tied, as in SmolLM2.

    python scripts/gguf_random.py OUT.gguf [--shape smollm2-1.7b] [--tokenizer IN.gguf]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from predd.model.loader import default_model_path  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float


# SmolLM2's larger sizes share the 135M model's 49152-token vocabulary (so its tokenizer)
SHAPES = {
    # a step as fast as a GPU's on any CPU: what is left is predd's per-token overhead
    # (docs/benchmarks.md, "B6: per-token overhead (`scripts/bench_loop.py`)")
    "tiny": Shape(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, rope_theta=10000.0),
    "smollm2-360m": Shape(hidden=960, ffn=2560, layers=32, heads=15, kv_heads=5,
                          rope_theta=100000.0),
    "smollm2-1.7b": Shape(hidden=2048, ffn=8192, layers=24, heads=32, kv_heads=32,
                          rope_theta=130000.0),
    # Llama-3-8B's body (4 q heads a kv head, head dim 128), SmolLM2's vocabulary; the
    # 8-layer cut is the GPU loop check's (scripts/gpu_check.sh loop): 4 GB to write
    "llama3-8b": Shape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                       rope_theta=500000.0),
    "llama3-8b-8l": Shape(hidden=4096, ffn=14336, layers=8, heads=32, kv_heads=8,
                          rope_theta=500000.0),
}


def block_tensors(shape: Shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One block's tensors, [out, in] as numpy (GGUF stores the shape reversed)."""
    head_dim = shape.hidden // shape.heads
    scale = shape.hidden ** -0.5

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16)

    ones = np.ones(shape.hidden, dtype=np.float32)
    return {
        "attn_norm.weight": ones, "ffn_norm.weight": ones,
        "attn_q.weight": w(shape.heads * head_dim, shape.hidden),
        "attn_k.weight": w(shape.kv_heads * head_dim, shape.hidden),
        "attn_v.weight": w(shape.kv_heads * head_dim, shape.hidden),
        "attn_output.weight": w(shape.hidden, shape.heads * head_dim),
        "ffn_gate.weight": w(shape.ffn, shape.hidden),
        "ffn_up.weight": w(shape.ffn, shape.hidden),
        "ffn_down.weight": w(shape.hidden, shape.ffn),
    }


def write(dst: str, shape: Shape, tokenizer_src: str, seed: int = 0) -> int:
    """Bytes written to `dst`: `shape` with random weights, `tokenizer_src`'s vocabulary."""
    reader = gguf.GGUFReader(tokenizer_src)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(dst, "llama")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    block = block_tensors(shape, rng)
    globals_ = {
        "token_embd.weight": (rng.standard_normal((vocab, shape.hidden), dtype=np.float32)
                              * 0.02).astype(np.float16),
        "output_norm.weight": np.ones(shape.hidden, dtype=np.float32),
    }
    tensors = list(globals_.items()) + [
        (f"blk.{i}.{name}", t) for i in range(shape.layers) for name, t in block.items()]
    for name, t in tensors:
        writer.add_tensor_info(name, t.shape, t.dtype, t.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tensors:
        writer.write_tensor_data(t)
    writer.close()
    return os.path.getsize(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", help="the GGUF whose vocabulary to use "
                    "(default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    size = write(args.out, SHAPES[args.shape], args.tokenizer or default_model_path())
    print(f"{args.out}: {args.shape} {SHAPES[args.shape]}, random F16, {size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
