"""predd's GGUF reader (predd/model/gguf_file.py) against gguf's own `GGUFReader`: the
same metadata, value for value and type for type, and the same tensors, byte for byte,
on files written by gguf's `GGUFWriter` in both byte orders and on the model predd
serves; what is no GGUF file is refused."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from predd.model.gguf_file import GGUFFile
from predd.model.loader import default_model_path


def same_as_gguf(path: str) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(want)
    for key, value in want.items():
        got = ours.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape, a.n_elements, a.n_bytes) == \
            (b.name, b.tensor_type, tuple(int(d) for d in b.shape), b.n_elements, b.n_bytes)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, np.asarray(b.data)), a.name
        assert not a.data.flags.writeable
    return ours


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_and_tensor_kind_reads_as_ggufs_reader_reads_it(tmp_path, endian):
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ wörld")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "Ġthe", "<|endoftext|>"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = same_as_gguf(path)
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.bools"] == [True, False, True]
    q = ours.tensors[-1]
    assert q.shape == (64, 4) and q.data.shape == (4, 2 * 34)      # two Q8_0 blocks a row


def test_the_served_model_reads_as_ggufs_reader_reads_it():
    ours = same_as_gguf(default_model_path())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


def test_what_is_no_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        GGUFFile(str(bad))


def gguf_bytes(kvs: list[bytes], tensors: list[bytes], n_kv: int | None = None,
               n_tensors: int | None = None) -> bytes:
    """A little-endian version-3 file: its key-values and tensor infos as given."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    return head + b"".join(kvs) + b"".join(tensors)


def text(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def kv_u32(key: str, value: int) -> bytes:
    return text(key) + struct.pack("<II", 4, value)


def tensor(name: str, dims: list[int], kind: int, offset: int = 0) -> bytes:
    return text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


Q4_K = int(gguf.GGMLQuantizationType.Q4_K)


@pytest.mark.parametrize("data, why", [
    (b"GGUF" + bytes(8), "shorter than its header"),
    (gguf_bytes([], [], n_kv=1), "malformed"),                          # a key-value missing
    (gguf_bytes([struct.pack("<Q", 2**40) + b"k"], []), "past the file's end"),   # a key's length
    (gguf_bytes([text("k") + struct.pack("<IIQ", 9, 4, 2**62)], []), "past the file's end"),
    (gguf_bytes([text("k") + struct.pack("<IIQ", 9, 4, 2**64 - 1)], []), "past the file's end"),
    (gguf_bytes([kv_u32("k", 1), kv_u32("k", 2)], []), "appears twice"),
    (gguf_bytes([], [text("t") + struct.pack("<I", 2**31)]), "more than 4"),
    (gguf_bytes([], [tensor("t", [257], Q4_K)]), "not whole blocks"),
    (gguf_bytes([], [tensor("t", [8], 0, offset=2**40)]), "runs past the file's end"),
    (gguf_bytes([], [tensor("t", [8], 999)]), "not one GGML knows"),
    (gguf_bytes([text("general.alignment") + struct.pack("<IB", 7, 1)], []), "power of two"),
])
def test_a_malformed_or_hostile_file_is_refused_by_name(tmp_path, data, why):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match=why) as caught:
        GGUFFile(str(bad))
    assert str(bad) in str(caught.value)
