"""Requests: one dataclass per op, and their validation (`decode_request`): types, sizes
and shapes checked at the boundary, ProtocolError (EINVAL, E2BIG, EBADMSG, ENOSYS) and
nothing else for bad input."""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
RIGHTS = ("r", "rw")
CAP_HEX_LEN = 32  # 128-bit capabilities, hex
# Sizes any request field may have, whatever the model (predd's own, smaller, limits
# follow from its model: see predd/server/request_limits.py). Beyond them a request is E2BIG.
MAX_ITEMS = 1 << 20      # items of a list field
MAX_CHARS = 1 << 24      # characters of a str field, bytes of a bytes field


class ProtocolError(Exception):
    """An errno-named failure that travels over the wire."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Request:
    rid: int
    op: ClassVar[str] = ""


@dataclass
class Hello(Request):
    client: str = ""
    pid: int = 0
    uid: int = -1
    lease_s: float = 10.0
    token: str = ""          # tcp:// clients: the secret that names their uid
    logits_fd: int = -1      # ipc: a sealed memfd of the client's for pred logits (its fd)
    logits_slots: int = 0    # ... holding this many rows (predd/server/logits_buffer.py)
    op: ClassVar[str] = "hello"


@dataclass
class Bye(Request):
    op: ClassVar[str] = "bye"


@dataclass
class Ping(Request):
    op: ClassVar[str] = "ping"


@dataclass
class Info(Request):
    op: ClassVar[str] = "info"


@dataclass
class Stats(Request):
    op: ClassVar[str] = "stats"


@dataclass
class Ps(Request):
    op: ClassVar[str] = "ps"


@dataclass
class Fsck(Request):
    op: ClassVar[str] = "fsck"


@dataclass
class Tokenize(Request):
    text: str = ""
    add_special: bool = False
    op: ClassVar[str] = "tokenize"


@dataclass
class Detokenize(Request):
    tokens: list[int] = field(default_factory=list)
    skip_special: bool = False
    op: ClassVar[str] = "detokenize"


@dataclass
class TokenizerSpec(Request):
    """The served model's tokenizer as Hugging Face tokenizers' JSON: a client decodes
    ids to text itself, as `detokenize` would, without a round trip a chunk."""
    op: ClassVar[str] = "tokenizer"


@dataclass
class ChatTemplate(Request):
    messages: list[dict] = field(default_factory=list)
    add_generation_prompt: bool = True
    op: ClassVar[str] = "chat_template"


@dataclass
class KvCreate(Request):
    persist: bool = False
    owner: int | None = None   # charge to this uid (trusted peers only: kvfsd)
    op: ClassVar[str] = "kv_create"


@dataclass
class KvFork(Request):
    cap: str = ""
    rights: str = "rw"
    persist: bool = False
    owner: int | None = None   # charge to this uid (trusted peers only: kvfsd)
    op: ClassVar[str] = "kv_fork"


@dataclass
class KvGrant(Request):
    """A second capability to the same object, with rights at most the given one's."""
    cap: str = ""
    rights: str = "r"
    persist: bool = False
    op: ClassVar[str] = "kv_grant"


@dataclass
class KvFree(Request):
    cap: str = ""
    op: ClassVar[str] = "kv_free"


@dataclass
class KvStat(Request):
    cap: str = ""
    op: ClassVar[str] = "kv_stat"


@dataclass
class KvPolicy(Request):
    """Memory policy for an object (rights rw): pin it on the device, unpin it, or move
    it down a tier now (`evict`)."""
    cap: str = ""
    pin: bool | None = None
    evict: bool = False
    op: ClassVar[str] = "kv_policy"


@dataclass
class IoWait(Request):
    """The session waits on I/O (`on`) or is back: while it waits, the objects of `caps`
    (by default every object the session holds a capability to) are the first to move
    down a tier; a call on one ends its wait."""
    on: bool = True
    caps: list[str] = field(default_factory=list)
    op: ClassVar[str] = "io_wait"


@dataclass
class KvTokens(Request):
    cap: str = ""
    start: int = 0
    end: int | None = None
    op: ClassVar[str] = "kv_tokens"


@dataclass
class KvTruncate(Request):
    cap: str = ""
    length: int = 0
    op: ClassVar[str] = "kv_truncate"


@dataclass
class KvExtract(Request):
    cap: str = ""
    ranges: list[list[int]] = field(default_factory=list)
    persist: bool = False
    owner: int | None = None   # charge to this uid (trusted peers only: kvfsd)
    op: ClassVar[str] = "kv_extract"


@dataclass
class KvMerge(Request):
    caps: list[str] = field(default_factory=list)
    persist: bool = False
    owner: int | None = None   # charge to this uid (trusted peers only: kvfsd)
    op: ClassVar[str] = "kv_merge"


@dataclass
class KvExport(Request):
    cap: str = ""
    op: ClassVar[str] = "kv_export"


@dataclass
class KvImport(Request):
    """Followed by one binary frame: the bytes `kv_export` returned."""
    persist: bool = False
    owner: int | None = None   # charge to this uid (trusted peers only: kvfsd)
    op: ClassVar[str] = "kv_import"


@dataclass
class Pred(Request):
    cap: str = ""
    tokens: list[int] = field(default_factory=list)
    positions: list[int] | None = None
    outputs: list[int] | None = None
    sample: dict | None = None
    topk: int = 0
    mask: list[int] | bytes | None = None
    into: int = -1           # a slot of the session's logits buffer for the one row
    op: ClassVar[str] = "pred"


@dataclass
class Cancel(Request):
    """End the caller's own pred or generate `target` (its rid) now: a generate that has
    produced tokens finishes with `cancelled` (what it generated kept, as at `length`);
    any other call gets ECANCELED, its object as it was."""
    target: int = 0
    op: ClassVar[str] = "cancel"


@dataclass
class Generate(Request):
    cap: str = ""
    tokens: list[int] = field(default_factory=list)
    max_tokens: int = 16
    sample: dict | None = None
    stop: list[int] | None = None
    stop_text: list[str] = field(default_factory=list)
    stream: bool = True
    op: ClassVar[str] = "generate"


REQUESTS: dict[str, type[Request]] = {
    cls.op: cls for cls in (
        Hello, Bye, Ping, Info, Stats, Ps, Fsck, Tokenize, Detokenize, TokenizerSpec,
        ChatTemplate, KvCreate, KvFork, KvGrant, KvFree, KvStat, KvTokens, KvTruncate, KvExtract,
        KvMerge, KvExport, KvImport, KvPolicy, IoWait, Pred, Generate, Cancel)
}

SAMPLE_KEYS = {"temperature": float, "top_p": float, "top_k": int, "seed": int}


@dataclass(frozen=True)
class SampleParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @classmethod
    def from_wire(cls, raw: dict | None) -> SampleParams | None:
        if raw is None:
            return None
        for key, value in raw.items():
            kind = SAMPLE_KEYS.get(key)
            if kind is None:
                raise ProtocolError("EINVAL", f"sample: unknown key {key!r}")
            if value is None and key == "seed":
                continue
            if not _is_instance(value, kind):
                raise ProtocolError("EINVAL", f"sample.{key}: expected {kind.__name__}")
        params = cls(**raw)
        if (not math.isfinite(params.temperature) or params.temperature < 0
                or not 0 < params.top_p <= 1 or params.top_k < 0):
            raise ProtocolError("EINVAL", "sample: need a finite temperature >= 0, "
                                "0 < top_p <= 1, top_k >= 0")
        return params


def _is_instance(value: Any, kind: Any) -> bool:
    """isinstance for the few annotation shapes the records use."""
    return _checker(kind)(value)


@functools.cache
def _checker(kind: Any) -> Callable[[Any], bool]:
    """`_is_instance(., kind)` as one function, made once per annotation: a request's
    fields are checked without taking their annotations apart again (measured:
    docs/kernels.md, "Request fields checked by prebuilt checkers")."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return lambda value: True
    if origin in (typing.Union, types.UnionType):
        parts = tuple(_checker(arg) for arg in typing.get_args(kind))
        return lambda value: any(part(value) for part in parts)
    if kind is type(None):
        return lambda value: value is None
    if kind is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return _is_int
    if origin is list:
        (item,) = typing.get_args(kind) or (Any,)
        if item is int:   # token ids: one type() test an item, ~10x faster, the same answers
            return lambda value: isinstance(value, list) and all(
                type(v) is int or _is_int(v) for v in value)
        check = _checker(item)
        return lambda value: isinstance(value, list) and all(check(v) for v in value)
    if origin is dict:
        return lambda value: isinstance(value, dict)
    return lambda value: isinstance(value, kind)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


@functools.cache
def _field_checks(cls: type) -> dict[str, Callable[[Any], bool]]:
    """Each field of record `cls` and the check of its annotation."""
    hints = _hints(cls)
    return {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}


def decode_frames(frames: list[bytes]) -> tuple[dict, list[bytes]]:
    """Unpack the header frame of a message; raise EBADMSG on anything but a msgpack map."""
    if not frames:
        raise ProtocolError("EBADMSG", "empty message")
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError("EBADMSG", f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("EBADMSG", "header is not a map")
    return header, list(frames[1:])


def decode_request(header: dict) -> Request:
    """Validate a raw request map into its record; ProtocolError on any mismatch."""
    op = header.get("op")
    rid = header.get("rid")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError("EINVAL", "rid: expected int")
    if not isinstance(op, str):
        raise ProtocolError("EINVAL", "op: expected str")
    cls = REQUESTS.get(op)
    if cls is None:
        raise ProtocolError("ENOSYS", f"unknown op {op!r}")
    checks = _field_checks(cls)
    kwargs = {}
    for key, value in header.items():
        if key == "op":
            continue
        check = checks.get(key)
        if check is None:
            raise ProtocolError("EINVAL", f"{op}: unknown field {key!r}")
        _check_size(f"{op}.{key}", value)
        if not check(value):
            raise ProtocolError("EINVAL", f"{op}.{key}: expected {_type_name(_hints(cls)[key])}")
        kwargs[key] = value
    if op == "kv_extract" and any(len(r) != 2 for r in kwargs.get("ranges", [])):
        raise ProtocolError("EINVAL", "kv_extract.ranges: each range is [start, end]")
    return cls(**kwargs)


def _check_size(what: str, value: Any) -> None:
    if isinstance(value, list) and len(value) > MAX_ITEMS:
        raise ProtocolError("E2BIG", f"{what}: {len(value)} items, at most {MAX_ITEMS}")
    if isinstance(value, (str, bytes)) and len(value) > MAX_CHARS:
        raise ProtocolError("E2BIG", f"{what}: {len(value)} long, at most {MAX_CHARS}")


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def check_rights(rights: str) -> str:
    if rights not in RIGHTS:
        raise ProtocolError("EINVAL", f"rights must be one of {RIGHTS}, got {rights!r}")
    return rights
