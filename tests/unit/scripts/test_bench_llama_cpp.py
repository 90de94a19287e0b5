"""llama.cpp's baseline: its options by the CPU's flags, and its table parsed."""
from scripts.bench_llama_cpp import options, parse

ZEN4 = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SPR = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx_vnni\n"


def test_amx_runs_without_repacking_and_other_cpus_as_built():
    assert options(SPR) == ["--no-repack"]
    assert options(ZEN4) == []
    assert options("") == []


def test_the_table_gives_each_batch_its_seconds_and_generation_rate():
    text = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     64 |    1 |     96 |    0.124 |   258.11 |    0.701 |    91.31 |    0.825 |   116.38 |
|    32 |     64 |    8 |    768 |    0.860 |   297.81 |    2.903 |   176.38 |    3.762 |   204.12 |
"""
    assert parse(text) == {1: (0.825, 91.31), 8: (3.762, 176.38)}
