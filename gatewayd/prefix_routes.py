"""Which replica has seen a prompt's prefix: cache-aware routing of OpenAI requests.

Each replica's OpenAI LIP keeps its own prefix cache (files homed on that replica), so
a request is worth sending where an earlier prompt shared the longest prefix with it
(SGLang's cache-aware router, by prompt text). The router remembers the last
`per_replica` prompt strings sent to each replica (a prompt sent again moves to the
newest place) and answers with placement.choose: the longest shared prefix under the
load cap; a prefix shorter than `min_chars` counts as no match (every chat prompt
shares its template's first characters). Pure: no I/O, no clock.

A prompt string is what `prompt_text` makes of a request: the caller's scope first (the
LIP never shares a cache between scopes, so neither does routing), then the messages or
the completion prompt.
"""
from __future__ import annotations

import collections
import json
from collections.abc import Sequence

from gatewayd.placement import LOAD_CAP, choose

PER_REPLICA = 512
MIN_CHARS = 32


def shared_prefix(a: str, b: str) -> int:
    """len(os.path.commonprefix([a, b])), by bisection on C-speed slice compares."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prompt_text(scope: str, op: str, body) -> str:
    """The text a request's prompt starts with, for routing ("" when it has none)."""
    if not isinstance(body, dict):
        return ""
    if op == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                return ""
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"<{m.get('role')}>{content}\n")
        text = "".join(parts)
    elif op == "completion":
        prompt = body.get("prompt")
        # a batch by its first prompt, the one whose answer the program keeps
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    else:
        return ""
    return f"{scope}\0{text}"


class PrefixRoutes:
    def __init__(self, replicas: int, per_replica: int = PER_REPLICA,
                 min_chars: int = MIN_CHARS) -> None:
        self.min_chars = min_chars
        self.seen: list[collections.OrderedDict[str, None]] = [
            collections.OrderedDict() for _ in range(replicas)]
        self.per_replica = per_replica

    def longest(self, replica: int, prompt: str) -> int:
        """The longest prefix `prompt` shares with a prompt sent to `replica`."""
        best = 0
        for earlier in self.seen[replica]:
            if earlier[:best + 1] == prompt[:best + 1]:   # skip those that cannot beat it
                best = max(best, shared_prefix(earlier, prompt))
        return best if best >= self.min_chars else 0

    def route(self, prompt: str, loads: Sequence[int | None], cap: float = LOAD_CAP) -> int | None:
        """The replica for `prompt` (None: none is live); remembers the choice."""
        affinity = [self.longest(i, prompt) if load is not None and prompt else 0
                    for i, load in enumerate(loads)]
        chosen = choose(loads, affinity, cap)
        if chosen is not None and prompt:
            self.remember(chosen, prompt)
        return chosen

    def remember(self, replica: int, prompt: str) -> None:
        seen = self.seen[replica]
        seen.pop(prompt, None)
        seen[prompt] = None
        while len(seen) > self.per_replica:
            seen.popitem(last=False)
