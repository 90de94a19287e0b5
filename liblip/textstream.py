"""Tokens shown to the user as text while they come (the `lip` command and the example
LIPs share it).

A byte-level token can end in the middle of a UTF-8 character, so the output so far is
detokenized as a whole and only what is new and complete is written; special tokens
are not shown.
"""
from __future__ import annotations

from collections.abc import Iterable

from liblip.api import decode, send_to_user


class TextStream:
    """Feed it token ids; it writes (`send_to_user`) the text they add, holding back an
    incomplete character until the token that completes it. `tokens` is all it was fed."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.shown = ""

    def feed(self, token: int) -> None:
        self.tokens.append(token)
        text = decode(self.tokens, skip_special=True)
        if not text.endswith("\ufffd"):   # U+FFFD: the last character is not complete
            send_to_user(text[len(self.shown):])
            self.shown = text


def stream_text(tokens: Iterable[int]) -> list[int]:
    """Show `tokens` (e.g. a `generate_stream`) as they come; return them all."""
    stream = TextStream()
    for token in tokens:
        stream.feed(token)
    return stream.tokens
