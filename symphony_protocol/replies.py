"""Replies: one record per op's answer (`REPLIES`); `wire(rid)` is the map a server
sends, `decode_reply` turns a received map back into the record."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar


from symphony_protocol.requests import (
    Bye, Cancel, ChatTemplate, Detokenize, Fsck, Generate, Hello, Info, IoWait, KvCreate,
    KvExport, KvExtract, KvFork, KvFree, KvGrant, KvImport, KvMerge, KvPolicy, KvStat,
    KvTokens, KvTruncate, Ping, Pred, ProtocolError, Ps, REQUESTS, Request, Stats,
    Tokenize, TokenizerSpec, _hints)

@dataclass(kw_only=True)
class Reply:
    """A reply's results. `wire(rid)` is the map sent (`rid`, `ok` and the fields, under
    the same names), `frames()` the binary frames that follow it. Decode one with
    `decode_reply`."""
    ok: ClassVar[bool] = True

    def fields(self) -> dict:
        return {name: _wire_value(getattr(self, name)) for name in _names(type(self))}

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


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    """A record's field names, taken apart once per class."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _wire_value(value: Any) -> Any:
    if hasattr(type(value), "__dataclass_fields__"):
        return {name: getattr(value, name) for name in _names(type(value))}
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
    kv_dtype: str = ""         # the KV pool's dtype (predd --kv-dtype)
    kv_dtype_reason: str = ""  # why


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
    batch_picks_failed: int = 0   # a step's batched token picks that raised: its calls
                                  # picked one by one (0 from an older predd)
    answered_in_flight: int = 0   # requests answered while a step's pass ran on the device
                                  # (0 from an older predd)
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
    # {offered, hits, misses, wasted}: speculative continuation ({} from an older predd)
    speculation: dict = field(default_factory=dict)


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
class TokenizerReply(Reply):
    """The tokenizer's JSON (UTF-8) as the one binary frame: predd sends the same bytes
    to every caller, never packed again."""
    json: bytes = b""

    def fields(self) -> dict:
        return {}

    def frames(self) -> list[bytes]:
        return [self.json]

    @classmethod
    def from_wire(cls, header: dict, frames: list[bytes]) -> TokenizerReply:
        return cls(json=_one_frame(frames, "tokenizer"))


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
    Detokenize: DetokenizeReply, TokenizerSpec: TokenizerReply, ChatTemplate: ChatTemplateReply, KvCreate: KvReply,
    KvPolicy: KvReply, IoWait: EmptyReply,
    KvFork: KvReply, KvGrant: KvReply, KvFree: EmptyReply, KvStat: KvReply,
    KvTokens: KvTokensReply, KvTruncate: KvReply, KvExtract: KvReply, KvMerge: KvReply,
    KvExport: KvExportReply, KvImport: KvReply, Pred: PredReply, Generate: GenerateReply,
    Cancel: EmptyReply,
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
