"""OpenAI response bodies for the OpenAI LIP: whole answers, stream chunks, logprobs.

A logprob entry is `(token id, logprob, [(alternative id, logprob), ...])`; token
strings are the single token decoded with predd's tokenizer (`lip.decode`), cached.
"""
from __future__ import annotations

import threading
import time

import liblip as lip
from openai_lip.decode import Choice
from openai_lip.requests import Completion


class Formatter:
    def __init__(self, model: str) -> None:
        self.model = model
        self.token_text: dict[int, str] = {}
        self.lock = threading.Lock()

    def head(self, c: Completion, cid: str, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if c.chat \
            else "text_completion"
        return {"id": cid, "object": kind, "created": int(time.time()), "model": self.model}

    def token(self, t: int) -> str:
        with self.lock:
            text = self.token_text.get(t)
        if text is None:
            text = lip.decode([t])
            with self.lock:
                self.token_text[t] = text
        return text

    def logprobs(self, c: Completion, entries: list, offset: int = 0) -> dict | None:
        if not c.logprobs:
            return None
        if c.chat:
            def one(t, lp):
                s = self.token(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                                for t, lp, alts in entries]}
        tokens = [self.token(t) for t, _, _ in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if alts is None else self._top(t, lp, alts)
                                 for t, lp, alts in entries], "text_offset": offsets}

    def _top(self, token: int, logprob: float, alts: list) -> dict:
        """A completions entry's alternatives, the token's own among them (as vLLM
        lists it, whether or not it is one of the most likely)."""
        top = {self.token(a): alp for a, alp in alts}
        top.setdefault(self.token(token), logprob)
        return top

    def chunk(self, c: Completion, cid: str, ch: Choice, text, entries: list,
              finish: bool = False) -> dict | None:
        """One stream chunk for choice `ch`: its new text (or, for chat, the opening
        role delta, a dict) and the logprobs of the tokens that came with it; None when
        there is nothing to say."""
        if not (finish or text or entries):
            return None
        if c.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            choice = {"index": ch.index, "delta": delta, "logprobs": self.logprobs(c, entries)}
        else:
            choice = {"index": ch.index, "text": text,
                      "logprobs": self.logprobs(c, entries, ch.text_offset)}
            ch.text_offset += len(text)
        choice["finish_reason"] = ch.finish_reason if finish else None
        return {**self.head(c, cid, True), "choices": [choice]}

    def whole(self, c: Completion, cid: str, runs: list[tuple[list[int], list[Choice], list]],
              usage: dict) -> dict:
        """The whole answer: each prompt's ids with its choices (and, echoed with
        logprobs, the prompt's own logprob entries, which its choices' begin with), in
        index order."""
        out = []
        for prompt, choices, scored in runs:
            echo = lip.decode(prompt) if c.echo else ""
            out += [self._choice(c, ch, echo, scored) for ch in choices]
        return {**self.head(c, cid, False), "choices": out, "usage": usage,
                "system_fingerprint": None}

    def _choice(self, c: Completion, ch: Choice, echo: str, scored: list) -> dict:
        text = ch.out.full()
        if c.chat:
            return {"index": ch.index, "message": {"role": "assistant", "content": text},
                    "logprobs": self.logprobs(c, ch.entries), "finish_reason": ch.finish_reason}
        return {"index": ch.index, "text": echo + text,
                "logprobs": self.logprobs(c, scored + ch.entries, 0 if scored else len(echo)),
                "finish_reason": ch.finish_reason}
