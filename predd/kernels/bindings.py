"""The library's functions and structs as ctypes sees them: one table of every exported
function (its C declaration is csrc/kernels.h) and the structs the layer loop takes,
checked against the library at load. ctypes cannot read a C header, so the table is
the one copy on this side; `load` compares the structs' sizes and field offsets with
what the library reports (`kernel_layout`), so a struct changed on one side only
refuses the kernels, saying which, instead of passing fields at the wrong places.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from predd.kernels.build import KernelUnavailable

i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

attention = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i64,
             ptr, ptr]
TYPED = {   # one function per dtype: name_f32, name_bf16
    "paged_attention": (ctypes.c_int, attention),
    "add_rms_norm": (None, [ptr, ptr, ptr, ptr, i64, i64, f32]),
    "rope": (None, [ptr, i64, ptr, ptr, i64, i64, i64]),
    "silu_mul": (None, [ptr, ptr, i64, i64]),
}
SIGNATURES = {
    **{f"{op}_{t}": sig for op, sig in TYPED.items() for t in ("f32", "bf16")},
    "linear_q4_1_f32": (None, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr]),
    "linear_q8_0_f32": (None, [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]),
    "linear_q4_1_bf16": (None, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr]),
    "linear_q8_0_bf16": (None, [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]),
    "linear_q8_0_bf16_f32": (ctypes.c_int, [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]),
    "linear_q4_1_lanes_bf16": (None, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr]),
    "linear_q4_1_int8": (ctypes.c_int, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr]),
    "linear_q8_0_int8": (ctypes.c_int, [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]),
    "linear_int8_vector": (ctypes.c_int, []),
    "linear_bf16_dots": (ctypes.c_int, []),
    "linear_bf16_tiles": (ctypes.c_int, [ctypes.c_int]),
    "attention_tiles_bf16": (ctypes.c_int, [ctypes.c_int]),
    "greedy_pick_f32": (None, [ptr, i64, i64, ptr, ptr]),
    "sample_pick_f32": (None, [ptr, i64, i64, ptr, ptr, ptr, ptr]),
    "paged_attention_tiles_bf16": (ctypes.c_int, attention[:12] + [ptr, ptr, i64, i64, f32]),
    "shared_prefix_tiles_bf16": (ctypes.c_int, [ptr, i64, ptr, i64, i64, i64, i64, ptr,
                                                 ptr, ptr, ptr, ptr, ptr, ptr, i64, f32,
                                                 ptr]),
    "paged_attention_f32_kvbf16": (ctypes.c_int, attention),
    "store_entries": (None, [ptr, ptr, i64, ptr, ptr, i64, i64, i64]),
    "store_entries_bf16": (None, [ptr, ptr, i64, ptr, ptr, i64, i64, i64]),
    "plan_rows": (i64, [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr]),
    "plan_tiles": (i64, [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr]),
    "plan_prefixes": (i64, [ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr,
                            ptr]),
    "plan_step": (None, [i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr]),
    "run_layers_f32": (ctypes.c_int, [ptr, i64, ptr]),
    "run_layers_bf16": (ctypes.c_int, [ptr, i64, ptr]),
    "run_layers_f32_kvbf16": (ctypes.c_int, [ptr, i64, ptr]),
    "kernel_layout": (i64, [ptr, i64]),
}


class Prefixes(ctypes.Structure):
    """struct prefixes: SharedPrefixes of a set of rows (groups 0: none)"""
    _fields_ = [("index", ptr), ("row", ptr), ("rows", ptr), ("pages", ptr), ("groups", i64),
                ("start", ptr), ("prior", ptr)]


class Projection(ctypes.Structure):
    """struct projection: a projection's blocks (kind 4 Q4_1, 8 Q8_0, 5 Q4_1 in lanes; +
    INT8 by int8 dot products)"""
    _fields_ = [("kind", i64), ("k", i64), ("n", i64), ("q", ptr), ("d", ptr), ("m", ptr),
                ("bias", ptr)]


LANES = 5              # PREDD_LANES: the kind of Q4_1 blocks in lanes
INT8 = 16              # PREDD_INT8: added to a projection's kind


class Layer(ctypes.Structure):
    """struct layer: a decoder layer's weights and its part of the pool"""
    _fields_ = [("input_norm", ptr), ("post_norm", ptr), ("qkv", Projection),
                ("o", Projection), ("gate_up", Projection), ("down", Projection), ("kv", ptr)]


class Step(ctypes.Structure):
    """struct step: a step's rows, buffers and attention plan"""
    _fields_ = [(name, i64) for name in ("T", "C", "heads", "kv_heads", "head_dim", "inter",
                                         "page_size")] + [
        ("eps", f32), ("scale", f32),
        *((name, ptr) for name in ("x", "delta", "h", "qkv", "attn", "gate_up", "act",
                                   "cos", "sin", "store_rows", "indices", "row_token",
                                   "row_pages", "row_visible")),
        ("max_visible", i64), ("call_row", ptr), ("call_rows", ptr),
        ("calls", i64), ("rest_token", ptr), ("rest_pages", ptr), ("rest_visible", ptr),
        ("rest", i64), ("span_rows", i64), ("span_rest", i64), ("shared_rows", Prefixes),
        ("shared_rest", Prefixes), ("final_norm", ptr)]


STRUCTS = (Prefixes, Projection, Layer, Step)     # in kernel_layout's order


def layout() -> list[int]:
    """The structs' sizes and field offsets as ctypes lays them out, then the kind codes,
    in kernel_layout's order (csrc/kernels.h)."""
    values = []
    for struct in STRUCTS:
        values.append(ctypes.sizeof(struct))
        values += [getattr(struct, name).offset for name, _ in struct._fields_]
    return values + [LANES, INT8]


def load(path: Path) -> ctypes.CDLL:
    """The library at `path`, every function of SIGNATURES typed; KernelUnavailable where
    it cannot load, lacks one, or lays a struct out otherwise than the table."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path.name}: {exc}") from None
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise KernelUnavailable(f"{path.name} has no {name}") from None
        fn.restype, fn.argtypes = restype, argtypes
    want = layout()
    got = (ctypes.c_int64 * (len(want) + 1))()
    count = lib.kernel_layout(got, len(want))
    have = list(got[1:1 + min(count, len(want))])
    if count != len(want) or have != want:
        at = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
        raise KernelUnavailable(f"{path.name} lays its structs out otherwise than "
                                f"predd/kernels/bindings.py (value {at} of {len(want)}: "
                                f"{have[at] if at < len(have) else '-'} against "
                                f"{want[at] if at < len(want) else '-'})")
    return lib
