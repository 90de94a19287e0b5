"""`--dtype auto`: bf16 only where the CPU computes it natively."""
import pytest

from predd.model import dtype


def test_auto_on_avx2_only_cpu_is_float32():
    name, why = dtype.resolve("auto", "cpu", frozenset({"avx", "avx2", "fma"}))
    assert name == "float32"
    assert "no avx512_bf16/amx_bf16" in why


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_with_native_bf16_is_bfloat16(flag):
    name, why = dtype.resolve("auto", "cpu", frozenset({"avx2", flag}))
    assert (name, why) == ("bfloat16", f"auto: the CPU computes bf16 natively ({flag})")


def test_explicit_dtype_wins():
    assert dtype.resolve("bfloat16", "cpu", frozenset()) == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        dtype.resolve("int8", "cpu")


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nflags\t: other\n")
    assert dtype.cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert dtype.cpu_flags(str(tmp_path / "missing")) == frozenset()
