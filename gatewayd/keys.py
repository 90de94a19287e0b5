"""API keys: who a caller is (a name and a uid) and what they may use.

The file (`symphony serve --api-keys FILE`) has one key per line, `#` comments:

    KEY UID [NAME] [runs=N] [wall=SECONDS] [pages=N]
    sk-alice-7f3a9c0e5b1d2468 1001 alice runs=4 wall=600 pages=256

A run started with a key runs as its UID (so KV file modes apply to a remote user as to
a local one); NAME labels the key in logs and run listings (default `uid<UID>`); the
k=v fields override the server's default limits for this key. The file holds secrets:
it must be a regular file owned by root (or the server's user) with no group or other
bits, else it is refused. Keys are at least 16 characters; uid 0 is refused (a run is
never root). Lookup compares the presented key with every key in constant time.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, replace

from symphony_protocol import match_secret, read_private_file

MIN_KEY_LEN = 16
MAX_UID = 2**32 - 2


@dataclass(frozen=True)
class Limits:
    """Per-caller limits: concurrent runs, wall seconds per run, KV pages the caller's
    uid may hold when a run starts (0: predd's own quota is the only bound)."""
    runs: int = 4
    wall: float = 600.0
    pages: int = 0

    def with_fields(self, fields: dict[str, str], where: str) -> Limits:
        out = self
        for name, value in fields.items():
            if name not in ("runs", "wall", "pages"):
                raise ValueError(f"{where}: unknown limit {name!r} (runs, wall, pages)")
            try:
                number = float(value) if name == "wall" else int(value)
            except ValueError:
                raise ValueError(f"{where}: {name}={value!r} is not a number") from None
            if number < 0 or (name != "pages" and number == 0):
                raise ValueError(f"{where}: {name}={value} is out of range")
            out = replace(out, **{name: number})
        return out


@dataclass(frozen=True)
class Caller:
    """The identity behind a request: a name, the uid its runs get, its limits."""
    name: str
    uid: int
    limits: Limits


class ApiKeys:
    def __init__(self, entries: list[tuple[bytes, Caller]]) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def load(cls, path: str, defaults: Limits) -> ApiKeys:
        """Parse the file; ValueError with a message naming the file, line and problem."""
        text = read_private_file(path, "--api-keys")
        entries: list[tuple[bytes, Caller]] = []
        for n, line in enumerate(text.splitlines(), 1):
            where = f"--api-keys {path}:{n}"
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) < 2 or not fields[1].isdigit() or not 0 < int(fields[1]) <= MAX_UID:
                raise ValueError(f"{where}: expected `KEY UID [NAME] [runs=N] [wall=S] "
                                 "[pages=N]` with 0 < UID")
            key = fields[0].encode()
            if len(key) < MIN_KEY_LEN:
                raise ValueError(f"{where}: key shorter than {MIN_KEY_LEN} characters")
            if any(hmac.compare_digest(key, k) for k, _ in entries):
                raise ValueError(f"{where}: key listed twice")
            rest = fields[2:]
            name = f"uid{fields[1]}"
            if rest and "=" not in rest[0]:
                name, rest = rest[0], rest[1:]
            pairs = {}
            for item in rest:
                k, sep, v = item.partition("=")
                if not sep:
                    raise ValueError(f"{where}: {item!r} is not a k=v limit")
                pairs[k] = v
            entries.append((key, Caller(name, int(fields[1]),
                                        defaults.with_fields(pairs, where))))
        if not entries:
            raise ValueError(f"--api-keys {path}: no keys")
        return cls(entries)

    def lookup(self, key: str) -> Caller | None:
        return match_secret(self._entries, key)
