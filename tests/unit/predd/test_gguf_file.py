"""predd's GGUF reader (predd/model/gguf_file.py) against gguf's own `GGUFReader`: the
same metadata, value for value and type for type, and the same tensors, byte for byte,
on files written by gguf's `GGUFWriter` in both byte orders and on the model predd
serves; what is no GGUF file is refused."""
from __future__ import annotations

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
