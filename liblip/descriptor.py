"""The `.kv` file descriptor: what `cat a.kv` shows and what `cp` writes into b.kv.

    kvfs 1
    cap 3f9a...            (32 hex digits: a capability, fresh for each open)
    rights r|rw
    tokens N
    pages N
    model NAME

`kvfs 1` and `cap` are required when parsing; the other lines are informative. Anything
else is not a descriptor (ValueError; kvfsd answers EINVAL).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from liblip.protocol import CAP_HEX_LEN, RIGHTS

MAGIC = "kvfs 1"
MAX_LEN = 4096
_CAP = re.compile(rf"[0-9a-f]{{{CAP_HEX_LEN}}}")


@dataclass(frozen=True)
class Descriptor:
    cap: str
    rights: str = "r"
    tokens: int = 0
    pages: int = 0
    model: str = ""

    def render(self) -> str:
        return (f"{MAGIC}\ncap {self.cap}\nrights {self.rights}\ntokens {self.tokens}\n"
                f"pages {self.pages}\nmodel {self.model}\n")

    def encode(self) -> bytes:
        return self.render().encode()


def parse(data: bytes | str) -> Descriptor:
    if isinstance(data, bytes):
        if len(data) > MAX_LEN:
            raise ValueError("too long for a descriptor")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("not UTF-8 text") from None
    lines = [line.strip() for line in data.strip().splitlines()]
    if not lines or lines[0] != MAGIC:
        raise ValueError(f"a descriptor starts with {MAGIC!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        key, _, value = line.partition(" ")
        if key not in ("cap", "rights", "tokens", "pages", "model") or key in fields:
            raise ValueError(f"unexpected line {line[:40]!r}")
        fields[key] = value.strip()
    cap = fields.get("cap", "")
    if not _CAP.fullmatch(cap):
        raise ValueError(f"cap must be {CAP_HEX_LEN} lowercase hex digits")
    rights = fields.get("rights", "r")
    if rights not in RIGHTS:
        raise ValueError(f"rights must be one of {RIGHTS}")
    try:
        tokens = int(fields.get("tokens", "0"))
        pages = int(fields.get("pages", "0"))
    except ValueError:
        raise ValueError("tokens and pages are integers") from None
    return Descriptor(cap, rights, tokens, pages, fields.get("model", ""))
