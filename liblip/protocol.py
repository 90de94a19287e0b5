"""The wire format between LIPs, kvfsd and predd — written once, imported by all.

A request is one msgpack map `{"op": ..., "rid": int, ...fields}` optionally followed by
binary frames; a reply echoes `rid` with `"ok": true` and results, or `"ok": false` and
`{"error": {"code": ERRNO_NAME, "message": ...}}`. Every op's fields are a dataclass below;
`decode_request` validates a raw map against it (types, sizes, shapes) and raises
`ProtocolError` (EINVAL, E2BIG, EBADMSG, ENOSYS) — never anything else — so a server can
answer bad input and go on. Every op's reply is a record too (`REPLIES`): its
`wire(rid)` is the map predd sends, `decode_reply` turns a received map back into it. A
request gets exactly one terminal reply; a streamed generate sends `GenerateChunk`s
(`"more": true`) and then that one (`GenerateReply` or `ErrorReply`).
This module is pure Python (no torch, no zmq) so any process may import it.
"""
from __future__ import annotations

import dataclasses
import functools
import hmac
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
# follow from its model: see predd/server/limits.py). Beyond them a request is E2BIG.
MAX_ITEMS = 1 << 20      # items of a list field
MAX_CHARS = 1 << 24      # characters of a str field, bytes of a bytes field


class ProtocolError(Exception):
    """An errno-named failure that travels over the wire."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---------------------------------------------------------------- requests

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
        Hello, Bye, Ping, Info, Stats, Ps, Fsck, Tokenize, Detokenize, ChatTemplate,
        KvCreate, KvFork, KvGrant, KvFree, KvStat, KvTokens, KvTruncate, KvExtract,
        KvMerge, KvExport, KvImport, KvPolicy, IoWait, Pred, Generate)
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


# ---------------------------------------------------------------- replies

@dataclass(kw_only=True)
class Reply:
    """A reply's results. `wire(rid)` is the map sent (`rid`, `ok` and the fields, under
    the same names), `frames()` the binary frames that follow it. Decode one with
    `decode_reply`."""
    ok: ClassVar[bool] = True

    def fields(self) -> dict:
        return {f.name: _wire_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def frames(self) -> list[bytes]:
        return []

    def wire(self, rid: int | None) -> dict:
        return {"rid": rid, "ok": self.ok, **self.fields()}

    @classmethod
    def from_wire(cls, header: dict, frames: list[bytes]) -> Reply:
        """The record of a reply map; EBADMSG when a field is missing. Keys the record
        does not know (a newer predd's) are ignored."""
        hints = _hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in header:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError("EBADMSG", f"{cls.__name__}: no {f.name!r} field")
                continue
            value = header[f.name]
            kind = hints[f.name]
            kwargs[f.name] = kind(**value) if dataclasses.is_dataclass(kind) else value
        return cls(**kwargs)


def _one_frame(frames: list[bytes], what: str) -> bytes:
    """The one binary frame a reply carries; EBADMSG otherwise."""
    if len(frames) != 1:
        raise ProtocolError("EBADMSG", f"{what}: expected one binary frame")
    return frames[0]


def _wire_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


@dataclass(kw_only=True)
class ErrorReply(Reply):
    """`{"ok": false, "error": {"code": ERRNO_NAME, "message": ...}}`: the one reply to a
    request that failed (for a stream: its terminal message)."""
    code: str
    message: str
    ok: ClassVar[bool] = False

    @classmethod
    def of(cls, exc: ProtocolError) -> ErrorReply:
        return cls(code=exc.code, message=exc.message)

    def fields(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}

    @classmethod
    def from_wire(cls, header: dict, frames: list[bytes]) -> ErrorReply:
        error = header.get("error") or {}
        return cls(code=error.get("code", "EIO"), message=error.get("message", "unknown error"))


@dataclass(kw_only=True)
class EmptyReply(Reply):
    """bye, ping, kv_free: nothing but `ok`."""


@dataclass(kw_only=True)
class HelloReply(Reply):
    session: int
    version: int
    lease_s: float
    model: str
    uid: int                 # the session's: the kernel's, the token's or nobody
    trusted: bool
    logits_slot_bytes: int = 0   # the logits buffer's row stride; 0: no buffer
    logits_buffer: str = ""      # why hello's logits_fd was refused ("" if it was not)


@dataclass(kw_only=True)
class InfoReply(Reply):
    model: str
    vocab_size: int
    eos_ids: list[int]
    bos_id: int | None
    page_size: int
    pages_total: int
    pages_free: int
    bytes_per_page: int
    max_position: int
    device: str
    dtype: str
    dtype_reason: str
    attention: str
    num_layers: int
    version: int
    max_message_bytes: int
    host_pages: int = 0        # the host tier (0: none)
    disk_pages: int = 0        # the disk tier (0: none)
    linear: str = ""           # the projections: int8, quantized, packed or plain (predd --linear)
    linear_reason: str = ""    # why, and where quantized up to how many rows (measured)
    cuda_graphs: bool = False  # decode steps replayed as CUDA graphs (predd --cuda-graphs)
    cuda_graphs_reason: str = ""   # why (on or off)
    layer_loop: bool = False   # a CPU step's layers in one C call (predd --layer-loop)
    layer_loop_reason: str = ""    # why not, where it is off
    cascade: bool = False      # calls' shared prefixes attended together (predd --cascade)
    cascade_reason: str = ""   # why not, where it is off


@dataclass(kw_only=True)
class StatsReply(Reply):
    pages_total: int
    pages_free: int
    pages_used: int
    objects: int
    capabilities: int
    sessions: int
    steps: int                 # forward passes
    calls: int                 # call-chunks served
    mean_batch: float
    tokens_computed: int
    tokens_reused: int
    queue_wait_ms: float
    step_ms: float
    launch_wait_ms: float
    pending_calls: int
    requests: int
    errors: int
    throttled: int             # EAGAIN replies
    capped_steps: int          # steps the latency bound made smaller
    admission_waits: int       # calls that waited for room on the device
    # {buffer, frame}: raw pred rows by the way they went back ({} from an older predd)
    logits_rows: dict = field(default_factory=dict)
    tiers: dict                # {device|host|disk: {pages_total, pages_used}}
    pages_moved_down: int
    pages_moved_up: int
    bytes_moved: int
    time_ms: dict              # {schedule, prepare, forward, outputs, requests}: B4's split
    queue_wait_hist: dict      # {le_ms: [bounds], cumulative: [counts..., +inf], sum_ms}
    step_hist: dict
    uptime_s: float


@dataclass(kw_only=True)
class PsReply(Reply):
    sessions: list[dict]       # rows of docs/protocol.md `ps`
    ended: list[dict]
    uids: list[dict]


@dataclass(kw_only=True)
class FsckReply(Reply):
    clean: bool
    problems: list[str]
    pages_total: int
    pages_free: int
    objects: int


@dataclass(kw_only=True)
class TokenizeReply(Reply):
    tokens: list[int]


@dataclass(kw_only=True)
class DetokenizeReply(Reply):
    text: str


@dataclass(kw_only=True)
class ChatTemplateReply(Reply):
    text: str
    tokens: list[int]


@dataclass(kw_only=True)
class KvReply(Reply):
    """An object as it is now. `cap` is set (and sent) only for a new capability
    (create, fork, grant, extract, merge, import), `rights` only with a capability's
    (those and kv_stat); kv_truncate and kv_export send neither."""
    tokens: int                # entries
    pages: int
    bytes: int                 # pages * bytes_per_page
    last_position: int         # -1 when empty
    model: str
    tier: str = "device"       # the lowest tier holding one of its pages
    pinned: bool = False
    idle_s: float = 0.0        # since its last pred, generate, fork or export
    cap: str = ""
    rights: str = ""

    def fields(self) -> dict:
        out = {"tokens": self.tokens, "pages": self.pages, "bytes": self.bytes,
               "last_position": self.last_position, "model": self.model,
               "tier": self.tier, "pinned": self.pinned, "idle_s": self.idle_s}
        if self.cap:
            out["cap"] = self.cap
        if self.rights:
            out["rights"] = self.rights
        return out


@dataclass(kw_only=True)
class KvExportReply(KvReply):
    """The object, and its snapshot as the one binary frame."""
    snapshot: bytes = b""

    def frames(self) -> list[bytes]:
        return [self.snapshot]

    @classmethod
    def from_wire(cls, header: dict, frames: list[bytes]) -> KvExportReply:
        reply = super().from_wire(header, frames)
        reply.snapshot = _one_frame(frames, "kv_export")
        return reply


@dataclass(kw_only=True)
class KvTokensReply(Reply):
    tokens: list[int]
    positions: list[int]


@dataclass
class Cost:
    """What a pred or generate cost: tokens computed for it, entries it attended to
    without recomputing, the object's pages after it, its wait and its steps' time."""
    computed: int
    reused: int
    pages: int
    queue_ms: float
    step_ms: float
    swapped_in: int = 0        # entries brought back to the device for this call
    swap_ms: float = 0.0


@dataclass(kw_only=True)
class PredReply(Reply):
    """A pred's reply: one of the three below, by what the request asked for."""
    cost: Cost


@dataclass(kw_only=True)
class PredLogits(PredReply):
    """Raw logits: `logits: {shape, dtype: "float32"}`, and one binary frame of float32
    rows (row-major); or, for a request with `into`, `logits.slot` and no frame: the row
    is in that slot of the session's logits buffer."""
    shape: list[int]           # [outputs, vocab]
    data: bytes | memoryview   # predd sends a view of its logits (no copy); b"" in a slot
    slot: int = -1

    def fields(self) -> dict:
        logits = {"shape": list(self.shape), "dtype": "float32"}
        if self.slot >= 0:
            logits["slot"] = self.slot
        return {"logits": logits, "cost": _wire_value(self.cost)}

    def frames(self) -> list[bytes]:
        return [] if self.slot >= 0 else [self.data]

    @classmethod
    def from_wire(cls, header: dict, frames: list[bytes]) -> PredLogits:
        logits = header["logits"]
        slot = logits.get("slot", -1)
        data = b"" if slot >= 0 else _one_frame(frames, "pred logits")
        return cls(shape=list(logits["shape"]), data=data, slot=slot,
                   cost=Cost(**header["cost"]))


@dataclass(kw_only=True)
class PredSample(PredReply):
    """Sampled in predd: one token per output; `token`/`logprob` repeat the last
    (null with no outputs)."""
    tokens: list[int]
    logprobs: list[float]

    def fields(self) -> dict:
        return {"tokens": self.tokens, "logprobs": self.logprobs,
                "token": self.tokens[-1] if self.tokens else None,
                "logprob": self.logprobs[-1] if self.logprobs else None,
                "cost": _wire_value(self.cost)}


@dataclass(kw_only=True)
class PredTopk(PredReply):
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass(kw_only=True)
class GenerateChunk(Reply):
    """A streamed generate's token (`more: true`); the last comes in GenerateReply."""
    tokens: list[int]
    logprobs: list[float]

    def fields(self) -> dict:
        return {"more": True, "tokens": self.tokens, "logprobs": self.logprobs}


@dataclass(kw_only=True)
class GenerateReply(Reply):
    """A generate's one terminal message (`more: false`): streamed, its last token; not
    streamed, every generated token. `finish_reason`: stop, length or an errno name
    (ENOSPC, EDQUOT: no room for the next token)."""
    tokens: list[int]
    logprobs: list[float]
    generated: int
    finish_reason: str
    cost: Cost

    def fields(self) -> dict:
        return {"more": False, **super().fields()}


REPLIES: dict[type[Request], type[Reply]] = {
    Hello: HelloReply, Bye: EmptyReply, Ping: EmptyReply, Info: InfoReply,
    Stats: StatsReply, Ps: PsReply, Fsck: FsckReply, Tokenize: TokenizeReply,
    Detokenize: DetokenizeReply, ChatTemplate: ChatTemplateReply, KvCreate: KvReply,
    KvPolicy: KvReply, IoWait: EmptyReply,
    KvFork: KvReply, KvGrant: KvReply, KvFree: EmptyReply, KvStat: KvReply,
    KvTokens: KvTokensReply, KvTruncate: KvReply, KvExtract: KvReply, KvMerge: KvReply,
    KvExport: KvExportReply, KvImport: KvReply, Pred: PredReply, Generate: GenerateReply,
}


def decode_reply(op: str, header: dict, frames: list[bytes] | tuple = ()) -> Reply:
    """The record of a reply to `op` (ErrorReply for `ok: false`); EBADMSG if it does
    not fit."""
    if header.get("ok") is not True:
        return ErrorReply.from_wire(header, list(frames))
    request = REQUESTS.get(op)
    if request is None:
        raise ProtocolError("ENOSYS", f"unknown op {op!r}")
    cls = REPLIES[request]
    if cls is PredReply:
        cls = (PredLogits if "logits" in header else PredTopk if "topk_ids" in header
               else PredSample)
    elif cls is GenerateReply and header.get("more"):
        cls = GenerateChunk
    try:
        return cls.from_wire(header, list(frames))
    except (KeyError, TypeError) as exc:
        raise ProtocolError("EBADMSG", f"{op} reply: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------- validation

def _is_instance(value: Any, kind: Any) -> bool:
    """isinstance for the few annotation shapes the records use."""
    return _checker(kind)(value)


@functools.cache
def _checker(kind: Any) -> Callable[[Any], bool]:
    """`_is_instance(., kind)` as one function, made once per annotation: a request's
    fields are checked without taking their annotations apart again (a pred request
    6.5 -> ~3 us to validate)."""
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


# ---------------------------------------------------------------- encoding

def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_request(op: str, rid: int, fields_: dict) -> bytes:
    return pack({"op": op, "rid": rid, **fields_})


# ---------------------------------------------------------------- where things are

SYSTEM_RUNDIR = "/run/symphony"


def default_rundir() -> str:
    """$SYMPHONY_RUNDIR, else /run/symphony for root, else a per-user directory under
    $XDG_RUNTIME_DIR or /tmp. predd refuses a rundir it does not own or that others
    can write (predd/server/loop.py)."""
    import os
    if os.environ.get("SYMPHONY_RUNDIR"):
        return os.environ["SYMPHONY_RUNDIR"]
    if os.geteuid() == 0:
        return SYSTEM_RUNDIR
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"symphony-{os.geteuid()}")


def same_endpoint_key(addr: str) -> str:
    """One spelling per ipc socket path (normalized, absolute), so two spellings of one
    predd compare equal; other addresses as given."""
    import os
    if addr.startswith("ipc://") and len(addr) > 6:
        return "ipc://" + os.path.normpath(os.path.abspath(addr[6:]))
    return addr


def default_addr(rundir: str | None = None) -> str:
    """Where a client finds predd: $PREDD_ADDR, else the socket in $SYMPHONY_RUNDIR,
    else the system predd's (/run/symphony/predd.sock) when it exists, else the socket
    in the per-user rundir. With `rundir`, the socket in that directory."""
    import os
    if rundir is not None:
        return f"ipc://{os.path.join(rundir, 'predd.sock')}"
    if os.environ.get("PREDD_ADDR"):
        return os.environ["PREDD_ADDR"]
    system = os.path.join(SYSTEM_RUNDIR, "predd.sock")
    if not os.environ.get("SYMPHONY_RUNDIR") and os.path.exists(system):
        return f"ipc://{system}"
    return f"ipc://{os.path.join(default_rundir(), 'predd.sock')}"


def default_mount() -> str:
    import os
    return os.environ.get("KVFS_MOUNT", "/mnt/kvfs")


def default_token() -> str:
    """$SYMPHONY_TOKEN: the secret a tcp:// client names its uid with (predd --auth-keys)."""
    import os
    return os.environ.get("SYMPHONY_TOKEN", "")


# ---------------------------------------------------------------- transport policy

def is_loopback_host(host: str) -> bool:
    """Whether a host name or address is loopback only ("*", 0.0.0.0 and names are not)."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_private_file(path: str, flag: str) -> str:
    """The text of a secrets file (tokens, API keys): a regular file, not a symlink, with
    no group or other bits, owned by root or this process's euid. ValueError naming
    `flag` and the problem otherwise."""
    import os
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "r", encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{flag} {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):04o} "
                             "lets group or others read it (chmod 600)")
        if st.st_uid not in (0, os.geteuid()):
            raise ValueError(f"{flag} {path}: owned by uid {st.st_uid}, not by root or "
                             "this server's user")
        return f.read()


def match_secret(entries: list[tuple[bytes, Any]], given: str) -> Any | None:
    """The value paired with the secret `given` in `entries` ((secret, value) pairs), or
    None. Every entry is compared, each in constant time, so the time taken says
    nothing of which secret (or how much of one) matched."""
    given_b = given.encode()
    found = None
    for secret, value in entries:
        if hmac.compare_digest(given_b, secret) and found is None:
            found = value
    return found
