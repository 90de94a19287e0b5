"""Write a GGUF model cut to its first N layers: the same tokenizer, embedding, output
norm and blocks 0..N-1, `<arch>.block_count` set to N. For a device check whose
transfer is size-limited (scripts/gpu_check.sh): the whole SmolLM2-135M GGUF is 98 MB,
its first 4 layers 40 MB. The cut is a real model's first layers, not a trained model:
its tokens are deterministic but not sensible text.

N above the source's layer count grows the model instead: block i is the source's block
i mod count, so the 4-layer cut grown back to 30 layers has the whole model's shape and
cost (what a timing needs) on the other side of the transfer, not its weights.

    python scripts/gguf_cut.py OUT.gguf [--layers 4] [--model IN.gguf]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gguf  # noqa: E402

from predd.model.loader import default_model_path  # noqa: E402

# written by GGUFWriter itself
OWN_KEYS = ("GGUF.", "general.architecture")


def block_of(name: str) -> int | None:
    """The layer of a tensor named `blk.<i>.…`, else None."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else None


def names(name: str, count: int, layers: int) -> list[str]:
    """What source tensor `name` is written as in a model of `layers` layers cut or grown
    from `count`: a global tensor once, block b's as every block i < layers with
    i mod count == b."""
    b = block_of(name)
    if b is None:
        return [name]
    rest = name.split(".", 2)[2]
    return [f"blk.{i}.{rest}" for i in range(b, layers, count)]


def cut(src: str, dst: str, layers: int) -> tuple[int, int]:
    """(tensors written, bytes written) after writing `src` cut (or grown) to `layers`
    layers to `dst`."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    count = reader.fields[f"{arch}.block_count"].contents()
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, not {layers} (EINVAL)")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith(OWN_KEYS):
            continue
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub)
    kept = [(name, t) for t in reader.tensors for name in names(t.name, count, layers)]
    for name, t in kept:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return len(kept), os.path.getsize(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", help="the GGUF to cut (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    tensors, size = cut(args.model or default_model_path(), args.out, args.layers)
    print(f"{args.out}: {args.layers} layers, {tensors} tensors, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
