"""Text <-> token ids and the model's chat template, without transformers.

Owns building a `tokenizers.Tokenizer` from a Hugging Face directory (tokenizer.json +
tokenizer_config.json / generation_config.json) or from a GGUF file's byte-level BPE
metadata, the set of end-of-sequence ids, and rendering the model's own chat template in
a sandboxed jinja2 environment. Special tokens written in text (`<|im_start|>`) are
always parsed as the special token, never cut into pieces.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# Tokens that end a turn or a document in the ChatML-style vocabularies we serve; added
# to whatever eos the files name, so that generation stops at either.
_EXTRA_EOS = ("<|endoftext|>", "<|im_end|>")

# Pre-tokenizer split patterns, by GGUF `tokenizer.ggml.pre` (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """A model's tokenizer: ids, eos/bos, and its chat template."""

    def __init__(
        self,
        backend: Backend,
        eos_ids: list[int],
        bos_id: int | None,
        chat_template: str | None,
        special_strings: dict[str, str],
    ) -> None:
        self.backend = backend
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.chat_template = chat_template
        self._special_strings = special_strings  # bos_token, eos_token for templates
        self._compiled: Any = None
        self._spec: bytes | None = None

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Ids of `text`; `add_special` adds what the model's post-processor adds (BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def spec(self) -> bytes:
        """The backend as tokenizers' JSON, UTF-8 (made once): what a client decodes with."""
        if self._spec is None:
            self._spec = self.backend.to_str().encode()
        return self._spec

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._special_strings
        )


def _compile_template(source: str) -> Any:
    """The environment transformers renders chat templates in (sandboxed, trimmed)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a `.gguf` file or a Hugging Face model directory."""
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return _load_gguf(path)
    raise FileNotFoundError(f"not a .gguf file or a model directory: {path}")


def _eos_ids(backend: Backend, named: list[int]) -> list[int]:
    extra = [backend.token_to_id(t) for t in _EXTRA_EOS]
    return sorted({i for i in named + extra if i is not None})


# --- GGUF ---------------------------------------------------------------------------


def _gguf_pre_tokenizer(pre: str | None) -> Any:
    if pre == "smollm":
        # SmolLM2's own tokenizer.json (and llama.cpp's "smollm"): every digit alone,
        # then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2


def _load_gguf(path: str) -> Tokenizer:
    from predd.model.loader import gguf_reader

    field = gguf_reader(path).metadata.get

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face directory instead"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [])
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = Backend(bpe)
    backend.pre_tokenizer = _gguf_pre_tokenizer(field("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False)
         for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )

    bos_id = field("tokenizer.ggml.bos_token_id")
    eos_id = field("tokenizer.ggml.eos_token_id")
    if bos_id is not None and field("tokenizer.ggml.add_bos_token", False):
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)

    strings = {}
    if bos_id is not None:
        strings["bos_token"] = tokens[bos_id]
    if eos_id is not None:
        strings["eos_token"] = tokens[eos_id]
    return Tokenizer(
        backend,
        eos_ids=_eos_ids(backend, [] if eos_id is None else [int(eos_id)]),
        bos_id=None if bos_id is None else int(bos_id),
        chat_template=field("tokenizer.chat_template"),
        special_strings=strings,
    )


# --- Hugging Face directory ----------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_chat_template(path: str, tok_config: dict[str, Any]) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template


def _load_hf_dir(path: str) -> Tokenizer:
    backend = Backend.from_file(os.path.join(path, "tokenizer.json"))
    tok_config = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen_config = _read_json(os.path.join(path, "generation_config.json"))
    model_config = _read_json(os.path.join(path, "config.json"))

    bos = _token_content(tok_config.get("bos_token"))
    eos = _token_content(tok_config.get("eos_token"))
    named_eos = _as_list(gen_config.get("eos_token_id")) + _as_list(model_config.get("eos_token_id"))
    if eos is not None and backend.token_to_id(eos) is not None:
        named_eos.append(backend.token_to_id(eos))
    bos_id = backend.token_to_id(bos) if bos is not None else None
    if bos_id is None:
        bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))

    strings = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    return Tokenizer(
        backend,
        eos_ids=_eos_ids(backend, named_eos),
        bos_id=None if bos_id is None else int(bos_id),
        chat_template=_hf_chat_template(path, tok_config),
        special_strings=strings,
    )
