"""What one request may ask of predd: the bounds that keep a cheap request from one
client costing everyone else memory or time (docs/design.md §9).

Each bound caps what a request can make predd allocate, compute or send back, so every
reply's size follows from what the caller is entitled to. The rule for codes: a list,
string or count over its bound is E2BIG; a value out of its range is EINVAL; a position
that would not fit the int32 the pool stores is EOVERFLOW. `context` (entries per
object, tokens per call, generated tokens per call) defaults to the model's context
length; the rest are fixed numbers. Checks here are pure: they raise before anything is
queued or allocated.
"""
from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass, replace

import symphony_protocol as p
from symphony_protocol import ProtocolError

MAX_POSITION = 2**31 - 1   # positions are stored as int32: valid ones are [0, MAX_POSITION)


@dataclass(frozen=True)
class Limits:
    context: int = 0             # entries per object, tokens per pred/generate; 0: the model's
    output_rows: int = 4096      # logit rows one pred may ask for (`outputs`, repeats count)
    topk: int = 1024             # largest pred `topk` (and never above the vocabulary)
    merge_caps: int = 64         # objects one kv_merge may name
    extract_ranges: int = 1024   # ranges one kv_extract may name
    stop_ids: int = 1024         # generate `stop` ids
    stop_texts: int = 16         # generate `stop_text` strings...
    stop_text_chars: int = 256   # ...of at most this many characters each
    text_chars: int = 1 << 20    # tokenize text; chat_template messages in all
    text_tokens: int = 1 << 18   # detokenize ids
    messages: int = 4096         # chat_template messages

    def resolved(self, model_context: int) -> Limits:
        """These limits with `context` filled in from the model when it is 0."""
        return self if self.context else replace(self, context=model_context)

    # ------------------------------------------------------------ helpers

    @staticmethod
    def count(what: str, items: Sized | int, limit: int) -> None:
        """E2BIG when `items` (a collection or a number of things) exceeds `limit`."""
        n = items if isinstance(items, int) else len(items)
        if n > limit:
            raise ProtocolError("E2BIG", f"{what}: {n} is more than the limit of {limit}")

    @staticmethod
    def ids(what: str, ids: list[int], vocab: int) -> None:
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ProtocolError("EINVAL", f"{what}: token ids must be in [0, {vocab})")

    # ------------------------------------------------------------ requests

    def check_pred(self, r: p.Pred, vocab: int) -> None:
        n = len(r.tokens)
        self.count("pred.tokens", n, self.context)
        self.ids("pred.tokens", r.tokens, vocab)
        if r.positions is not None and (len(r.positions) != n or any(
                not 0 <= q < MAX_POSITION for q in r.positions)):
            raise ProtocolError("EINVAL", f"pred.positions: one per token, in [0, {MAX_POSITION})")
        if r.outputs is not None:
            self.count("pred.outputs", r.outputs, self.output_rows)
        if not 0 <= r.topk <= min(self.topk, vocab):
            raise ProtocolError("EINVAL", f"pred.topk must be in [0, {min(self.topk, vocab)}]")
        if isinstance(r.mask, list):
            self.count("pred.mask", r.mask, vocab)

    def check_generate(self, r: p.Generate, vocab: int) -> None:
        self.count("generate.tokens", r.tokens, self.context)
        self.ids("generate.tokens", r.tokens, vocab)
        if not 1 <= r.max_tokens <= self.context:
            raise ProtocolError("EINVAL", f"generate.max_tokens must be in [1, {self.context}]")
        if r.stop is not None:
            self.count("generate.stop", r.stop, self.stop_ids)
            self.ids("generate.stop", r.stop, vocab)
        self.count("generate.stop_text", r.stop_text, self.stop_texts)
        for text in r.stop_text:
            if not text:
                raise ProtocolError("EINVAL", "generate.stop_text: an empty string")
            self.count("generate.stop_text characters", text, self.stop_text_chars)

    def check_text(self, what: str, text: str) -> None:
        self.count(f"{what} characters", text, self.text_chars)

    def check_messages(self, messages: list[dict]) -> None:
        self.count("chat_template.messages", messages, self.messages)
        for m in messages:
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ProtocolError("EINVAL", "messages: each needs str role and content")
        self.count("chat_template characters",
                   sum(len(m["role"]) + len(m["content"]) for m in messages), self.text_chars)
