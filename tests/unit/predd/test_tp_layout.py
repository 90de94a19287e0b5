"""predd/worker/tp.py without processes: how a model splits over ranks, the loader's part of
each weight, and a step's chunks as the int64 array rank 0 broadcasts."""
from __future__ import annotations

import numpy as np
import pytest

from predd.worker import tp
from predd.model.loader import ModelConfig
from predd.engine.chunk import Chunk
from tests.unit.helpers import refused_before_loading


def config(heads: int, kv: int, inter: int = 1536) -> ModelConfig:
    return ModelConfig("m", 100, 576, inter, 30, heads, kv, 64, 1e4, 1e-5, 2048, True)


def test_smollm2_splits_three_ways_one_kv_head_each():
    lays = [tp.layout(config(9, 3), 3, r) for r in range(3)]
    assert [(l.heads, l.kv_heads, l.columns) for l in lays] == [
        ((0, 3), (0, 1), (0, 512)), ((3, 6), (1, 2), (512, 1024)), ((6, 9), (2, 3), (1024, 1536))]
    local = tp.local_config(config(9, 3), lays[1])
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)


def test_more_ranks_than_kv_heads_replicate_each_kv_head():
    assert [tp.layout(config(8, 2), 4, r).kv_heads for r in range(4)] == \
        [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize("world,message", [
    (2, "--tp 2 does not divide the model's 9 query heads (EINVAL)"),
    (0, "--tp must be at least 1, not 0 (EINVAL)"),
])
def test_splits_that_cannot_work_are_refused(world, message):
    with pytest.raises(ValueError) as err:
        tp.layout(config(9, 3), world, 0)
    assert str(err.value) == message


def test_kv_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"--tp 4 does not divide the model's 6 KV heads"):
        tp.layout(config(12, 6), 4, 0)
    with pytest.raises(ValueError, match=r"--tp 6 is above the model's 4 KV heads and not a"):
        tp.layout(config(12, 4), 6, 0)
    with pytest.raises(ValueError, match=r"does not divide the model's MLP width 1000"):
        tp.layout(config(9, 3, inter=1000), 3, 0)


def test_each_weight_gives_its_rows_or_columns():
    of = tp.part_of(3, 1)
    cfg = config(9, 3)
    assert of(cfg, "model.layers.4.self_attn.q_proj.weight") == (0, 192, 384)
    assert of(cfg, "model.layers.4.self_attn.k_proj.weight") == (0, 64, 128)
    assert of(cfg, "model.layers.4.self_attn.v_proj.bias") == (0, 64, 128)
    assert of(cfg, "model.layers.4.self_attn.o_proj.weight") == (1, 192, 384)
    assert of(cfg, "model.layers.4.mlp.up_proj.weight") == (0, 512, 1024)
    assert of(cfg, "model.layers.4.mlp.down_proj.weight") == (1, 512, 1024)
    assert of(cfg, "model.embed_tokens.weight") is None
    assert of(cfg, "model.layers.4.input_layernorm.weight") is None


def test_chunks_round_trip_through_the_broadcast_array():
    chunks = [Chunk(np.array([5, 6, 7]), np.array([0, 1, 2]), np.array([4]), 3, np.array([2])),
              Chunk(np.array([9]), np.array([40]), np.array([1, 8, 3]), 41, np.array([0]))]
    flat = tp.encode_chunks(chunks)
    assert flat.dtype == np.int64 and len(flat) == 1 + 4 + 3 + 3 + 1 + 1 + 4 + 1 + 1 + 3 + 1
    back = tp.decode_chunks(flat)
    for a, b in zip(chunks, back):
        for field in ("tokens", "positions", "pages", "outputs"):
            assert getattr(b, field).tolist() == getattr(a, field).tolist()
        assert b.kv_len == a.kv_len


def test_dist_backend_is_nccl_on_cuda_and_gloo_on_cpu_unless_asked():
    assert tp.backend_for("auto", "cpu") == "gloo"
    assert tp.backend_for("auto", "cuda:1") == "nccl"
    assert tp.backend_for("gloo", "cuda") == "gloo"
    with pytest.raises(ValueError, match=r"^--dist-backend nccl needs a CUDA device, "
                       r"not cpu \(EINVAL\)$"):
        tp.backend_for("nccl", "cpu")


def test_predd_refuses_nccl_on_cpu_before_starting_a_rank(tmp_path, capsys):
    assert refused_before_loading(tmp_path, capsys, "--tp", "2", "--dist-backend", "nccl") == (
        2, "predd: --dist-backend nccl needs a CUDA device, not cpu (EINVAL)")
