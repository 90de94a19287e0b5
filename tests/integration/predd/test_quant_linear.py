"""SmolLM2-135M's Q4_1 / Q8_0 blocks, read for decode by `--linear quantized` (predd's
default where it runs) and `--linear int8`: the blocks are the weights predd dequantises,
to the bit; a runner computing from them gives the packed float32 runner's logits and
greedy tokens (by int8 dot products: its greedy tokens); `auto` takes int8 where
`--dtype auto` chose float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from predd.model.loader import load_weights, quantized_blocks
from predd.model import quant_linear
from predd.model.quant_linear import QuantLinear
from predd.engine.chunk import Chunk
from predd.worker.runner import Runner, RunnerConfig


def test_the_blocks_are_the_loaded_weights_to_the_bit(gguf_path):
    config, weights = load_weights(gguf_path, torch.float32)
    blocks = quantized_blocks(gguf_path, config)
    assert len(blocks) == 211                    # 30 layers x 7 projections + the embedding
    assert {b.kind for b in blocks.values()} == {"Q4_1", "Q8_0"}
    for name in ("model.layers.0.self_attn.q_proj.weight",     # rows un-permuted
                 "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):                 # Q8_0: the tied lm_head
        assert np.array_equal(blocks[name].dequantised(), weights[name].numpy()), name


def _greedy(runner: Runner, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill `prompt`, then decode `steps` tokens one at a time (one row: the blocks)."""
    pages = np.arange(8, dtype=np.int32)
    n = len(prompt)
    logits = runner.execute([Chunk(np.array(prompt, np.int32), np.arange(n, dtype=np.int32),
                                   pages[:-(-n // 16)], n, np.array([n - 1]))])[0]
    tokens, seen = [], []
    for _ in range(steps):
        seen.append(logits[0].numpy())
        tokens.append(int(logits[0].argmax()))
        logits = runner.execute([Chunk(np.array([tokens[-1]], np.int32), np.array([n], np.int32),
                                       pages[:-(-(n + 1) // 16)], n + 1, np.array([0]))])[0]
        n += 1
    return tokens, seen


@pytest.mark.slow
def test_quantized_runner_gives_the_packed_runners_tokens(gguf_path):
    prompt = [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]
    runs = {}
    for mode in ("packed", "quantized"):
        runner = Runner(RunnerConfig(gguf_path, kv_pages=8, linear=mode))
        assert runner.linear == mode
        for m in runner.model.modules():     # the blocks at decode's one row, whatever
            if isinstance(m, QuantLinear):   # start-up measured on this machine
                m.limit = 1
        with torch.inference_mode():
            runs[mode] = _greedy(runner, prompt, 24)
    assert runs["quantized"][0] == runs["packed"][0]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(runs["quantized"][1], runs["packed"][1]))
    assert worst <= 1e-3, worst


@pytest.mark.slow
def test_int8_rows_are_their_own_whatever_shares_their_step(gguf_path):
    """By int8 dot products, a decode's logits are the same bits alone and beside another
    call's 40-token prefill (the dense weight beyond a limit of the step's rows would
    change x's quantisation, and with it the tokens) or a 100-token one (the dense weight
    for that call alone), and that prompt's are its own; against the packed float32 runner
    the logits move (x quantised per block: here up to ~0.85 of values up to ~20), the
    first tokens of this prompt do not."""
    prompt = [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]
    runner = Runner(RunnerConfig(gguf_path, kv_pages=16, linear="int8", attention="cpu"))
    assert runner.call_rows is not None
    assert runner.linear == "int8" and "calls of up to 64 rows" in runner.linear_reason
    n = len(prompt)
    pages = np.arange(2, dtype=np.int32)
    with torch.inference_mode():
        runner.execute([Chunk(np.array(prompt, np.int32), np.arange(n, dtype=np.int32),
                              pages[:1], n, np.array([n - 1]))])
        decode = Chunk(np.array([198], np.int32), np.array([n], np.int32), pages[:1], n + 1,
                       np.array([0]))
        alone = runner.execute([decode])[0]
        other = Chunk(np.arange(100, 140, dtype=np.int32), np.arange(40, dtype=np.int32),
                      np.arange(4, 7, dtype=np.int32), 40, np.array([39]))
        beside = runner.execute([decode, other])[0]
        # a prompt longer than INT8_CALL_ROWS takes the dense weight, by itself: the
        # decode beside it keeps its int8 bits, and the prompt its own
        long = Chunk(np.arange(100, 200, dtype=np.int32), np.arange(100, dtype=np.int32),
                     np.arange(8, 15, dtype=np.int32), 100, np.array([99]))
        assert len(long.tokens) > quant_linear.INT8_CALL_ROWS
        prompt_alone = runner.execute([long])[0]
        with_long = runner.execute([decode, long])
        # two long prompts: in one GEMM where the dense weight's rows are independent
        # (`together`), each a GEMM of its own elsewhere; either way each its own bits
        second = Chunk(np.arange(300, 370, dtype=np.int32), np.arange(70, dtype=np.int32),
                       np.arange(2, 7, dtype=np.int32), 70, np.array([69]))
        second_alone = runner.execute([second])[0]
        both = runner.execute([long, decode, second])
    assert torch.equal(alone, beside)
    assert torch.equal(alone, with_long[0]) and torch.equal(prompt_alone, with_long[1])
    assert torch.equal(both[0], prompt_alone) and torch.equal(both[1], alone)
    assert torch.equal(both[2], second_alone)
    assert ("in one GEMM" in runner.linear_reason) is runner.call_rows.together
    runs = {}
    for mode in ("packed", "int8"):
        runner = Runner(RunnerConfig(gguf_path, kv_pages=8, linear=mode))
        with torch.inference_mode():
            runs[mode] = _greedy(runner, prompt, 2)
    assert runs["int8"][0] == runs["packed"][0] == [198, 198]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(runs["int8"][1], runs["packed"][1]))
    assert 1e-3 < worst <= 1.5, worst
    with pytest.raises(ValueError, match="--quant-rows applies to --linear quantized"):
        Runner(RunnerConfig(gguf_path, kv_pages=8, linear="int8", quant_rows=4))


@pytest.mark.parametrize("auto, linear", [(True, "int8"), (False, "quantized")])
def test_auto_takes_int8_where_dtype_auto_chose_float32(gguf_path, auto, linear):
    """`--dtype auto` choosing float32 (no bf16 arithmetic) lets `--linear auto` take the
    int8 dot products where the kernels have AVX2's; float32 asked for by name keeps the
    blocks' exact weights. `--linear int8` takes a float32 model only."""
    from predd.kernels import cpu_kernels
    if cpu_kernels.kernels().int8_dots == "portable":
        linear = "quantized"                  # no AVX2 here: auto keeps the exact blocks
    runner = Runner(RunnerConfig(gguf_path, kv_pages=8, dtype_auto=auto,
                                 quant_rows=None if linear == "int8" else 4))
    assert runner.linear == linear, runner.linear_reason
    assert ("by int8 dot products" in runner.linear_reason) == (linear == "int8")
    with pytest.raises(ValueError, match="--linear int8: the int8 dot products take a "
                                         "float32 model, not bfloat16 \\(EINVAL\\)"):
        Runner(RunnerConfig(gguf_path, dtype="bfloat16", kv_pages=8, linear="int8"))


def test_quantized_is_refused_where_it_cannot_run_and_auto_says_why(gguf_path, monkeypatch):
    from predd.kernels import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "problem", lambda: "no C compiler (cc) on PATH")
    with pytest.raises(ValueError) as err:
        Runner(RunnerConfig(gguf_path, kv_pages=8, linear="quantized"))
    assert str(err.value) == ("--linear quantized: CPU kernels unavailable: no C compiler "
                              "(cc) on PATH (EINVAL)")
    runner = Runner(RunnerConfig(gguf_path, kv_pages=8))
    assert runner.linear == "packed"


@pytest.mark.parametrize("rows", [0, 5])
def test_quant_rows_fixes_the_limit_without_measuring(gguf_path, rows, monkeypatch):
    from predd.model import quant_linear
    monkeypatch.setattr(quant_linear, "calibrate", lambda *a, **k: pytest.fail("measured"))
    runner = Runner(RunnerConfig(gguf_path, kv_pages=8, quant_rows=rows))
    assert runner.linear == "quantized"
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 121 and {m.limit for m in layers} == {rows}


def test_a_negative_quant_rows_is_refused(gguf_path):
    with pytest.raises(ValueError) as err:
        Runner(RunnerConfig(gguf_path, kv_pages=8, quant_rows=-1))
    assert str(err.value) == "--quant-rows must be 0 or more, not -1 (EINVAL)"
