"""The `.kv` file descriptor: what `cat a.kv` shows and what `cp` writes into b.kv.

    kvfs 1
    cap 3f9a...            (32 hex digits: a capability, fresh for each open)
    rights r|rw
    tokens N
    pages N
    model NAME
    replica ADDR           (optional: the predd replica that holds the cache)

`kvfs 1` and `cap` are required when parsing; the other lines are informative. Anything
else is not a descriptor: `parse` raises ValueError and nothing else, whatever the input
(kvfsd answers EINVAL). A `Descriptor` is valid by construction, so `parse(d.encode())
== d` for every one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from symphony_protocol import CAP_HEX_LEN, RIGHTS

MAGIC = "kvfs 1"
MAX_LEN = 4096
MAX_COUNT = 10**18 - 1          # tokens and pages: at most 18 decimal digits
MODEL_MAX = 256                 # bytes of UTF-8: a rendered descriptor stays far below MAX_LEN
_CAP = re.compile(rf"[0-9a-f]{{{CAP_HEX_LEN}}}")
_COUNT = re.compile(r"[0-9]{1,18}")
KEYS = ("cap", "rights", "tokens", "pages", "model", "replica")
ADDR_MAX = 256                  # bytes of a replica's address (ipc://PATH or tcp://HOST:PORT)
_ADDR = re.compile(r"(ipc|tcp)://[!-~]{1,%d}" % (ADDR_MAX - 6))


@dataclass(frozen=True)
class Descriptor:
    cap: str
    rights: str = "r"
    tokens: int = 0
    pages: int = 0
    model: str = ""
    replica: str = ""           # "" when the reader's own predd is meant (one replica)

    def __post_init__(self) -> None:
        if not isinstance(self.cap, str) or not _CAP.fullmatch(self.cap):
            raise ValueError(f"cap must be {CAP_HEX_LEN} lowercase hex digits")
        if self.rights not in RIGHTS:
            raise ValueError(f"rights must be one of {RIGHTS}")
        for name in ("tokens", "pages"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= MAX_COUNT:
                raise ValueError(f"{name} must be an integer in [0, {MAX_COUNT}]")
        if not isinstance(self.model, str) or not _valid_model(self.model):
            raise ValueError(f"model must be printable text of at most {MODEL_MAX} bytes "
                             "without surrounding spaces")
        if not isinstance(self.replica, str) or (self.replica
                                                 and not valid_replica(self.replica)):
            raise ValueError("replica must be an ipc:// or tcp:// address of printable "
                             f"ASCII without spaces, at most {ADDR_MAX} bytes")

    def render(self) -> str:
        return render(self.cap, self.rights, self.tokens, self.pages, self.model,
                      self.replica)

    def encode(self) -> bytes:
        return self.render().encode()


def render(cap: str, rights: str, tokens: int, pages: int, model: str,
           replica: str = "") -> str:
    """The descriptor's text (unchecked: `Descriptor` checks)."""
    return (f"{MAGIC}\ncap {cap}\nrights {rights}\ntokens {tokens}\n"
            f"pages {pages}\nmodel {model}\n" + (f"replica {replica}\n" if replica else ""))


def valid_replica(addr: str) -> bool:
    """An address a descriptor (or `user.kv.replica`) may name."""
    return bool(_ADDR.fullmatch(addr))


def _valid_model(model: str) -> bool:
    # str.isprintable() is False for every line break str.splitlines() knows.
    return (model == model.strip() and model.isprintable()
            and len(model.encode("utf-8", "replace")) <= MODEL_MAX)


def parse(data: bytes | str) -> Descriptor:
    """The descriptor in `data`; ValueError if it is not exactly one."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > MAX_LEN:
            raise ValueError("too long for a descriptor")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("not UTF-8 text") from None
    elif isinstance(data, str):
        text = data
        if len(text) > MAX_LEN:
            raise ValueError("too long for a descriptor")
    else:
        raise ValueError(f"a descriptor is bytes or text, not {type(data).__name__}")
    lines = [line.strip() for line in text.strip().splitlines()]
    if not lines or lines[0] != MAGIC:
        raise ValueError(f"a descriptor starts with {MAGIC!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        key, _, value = line.partition(" ")
        if key not in KEYS or key in fields:
            raise ValueError(f"unexpected line {line[:40]!r}")
        fields[key] = value.strip()
    if "cap" not in fields:
        raise ValueError("a descriptor names a capability (cap)")
    counts = {}
    for key in ("tokens", "pages"):
        value = fields.get(key, "0")
        if not _COUNT.fullmatch(value):
            raise ValueError(f"{key} is a decimal count")
        counts[key] = int(value)
    # Descriptor() checks the rest (cap, rights, model) and raises ValueError.
    return Descriptor(fields["cap"], fields.get("rights", "r"), counts["tokens"],
                      counts["pages"], fields.get("model", ""), fields.get("replica", ""))
