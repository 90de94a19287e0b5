"""The system calls a LIP makes: `import liblip as lip` (the model calls, `pred` and
`generate`, are in predict.py).

A process-wide client connects lazily to $PREDD_ADDR on first use and is shared by all
threads. KV handles are capabilities; `kv_open` gets one through kvfsd (a permission-
checked open of a `.kv` file, kept open while the handle lives, so POSIX unlink
semantics hold) and `kv_save` publishes one as a file (kvfsd forks it).

Replicas (docs/scaling.md): a cache file lives on one predd replica, named by its
descriptor. `kv_open` of a file homed on another replica first asks kvfsd to move it to
this process's predd (`user.kv.rehome`, counted as a migration); where that is refused
(no write permission, the file is open elsewhere) the handle stays on the file's own
replica, and every call on it goes there (`KV.replica`). `kv_open(..., move=False)`
never moves it: the handle works on the file where it is (the `lip` command opens
files so, and a shell user's files stay spread over the replicas). Objects of different
replicas cannot be combined (`kv_merge`: EXDEV).
"""
from __future__ import annotations

import atexit
import errno
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from symphony_protocol import descriptor
from liblip.client import Client, LipError
from symphony_protocol import default_mount, same_endpoint_key

_client: Client | None = None
_client_lock = threading.Lock()
_others: dict[str, Client] = {}            # clients of other replicas, by address
_info: tuple[Client, dict] | None = None   # info_cached: the reply and whose it is


def client() -> Client:
    """The process's predd connection, opened on first use."""
    global _client
    with _client_lock:
        if _client is None:
            _client = Client()
            atexit.register(_client.close)
        return _client


def connect(addr: str | None = None, **kwargs) -> Client:
    """(Re)connect the process-wide client, e.g. to a non-default address."""
    global _client, _info
    with _client_lock:
        if _client is not None:
            _client.close()
        _info = None   # another predd may serve another model
        _client = Client(addr, **kwargs)
        atexit.register(_client.close)
        return _client


def client_of(kv: KV) -> Client:
    """The client of the replica that holds `kv` (the process's own, usually)."""
    own = client()
    if not kv.replica or kv.replica == own.addr:
        return own
    with _client_lock:
        other = _others.get(kv.replica)
        if other is None:
            other = _others[kv.replica] = Client(kv.replica)
            atexit.register(other.close)
        return other


# ---------------------------------------------------------------- handles

_live: weakref.WeakValueDictionary[int, KV] = weakref.WeakValueDictionary()


@dataclass(eq=False)
class KV:
    """A capability to a KV object. `path`/`fd` are set when it came from a file."""
    cap: str
    rights: str = "rw"
    path: str | None = None
    fd: int | None = None
    closed: bool = False
    replica: str = ""       # the replica's address; "" = this process's predd

    @classmethod
    def from_capability(cls, cap: str, rights: str = "rw") -> KV:
        return cls(cap, rights)

    def __post_init__(self) -> None:
        _live[id(self)] = self

    def __repr__(self) -> str:   # capabilities are secrets: never print them whole
        where = f" {self.path}" if self.path else ""
        return f"<KV {self.rights}{where} cap:{self.cap[:4]}…>"

    def __enter__(self) -> KV:
        return self

    def __exit__(self, *exc) -> None:
        kv_close(self)


# ---------------------------------------------------------------- text and server

def tokenize(text: str, add_special: bool = False) -> list[int]:
    return client().call("tokenize", text=text, add_special=add_special)["tokens"]


def detokenize(tokens: Sequence[int], skip_special: bool = False) -> str:
    return client().call("detokenize", tokens=[int(t) for t in tokens],
                         skip_special=skip_special)["text"]


def decode(tokens: Sequence[int], skip_special: bool = False) -> str:
    """`detokenize`'s text, decoded in this process with predd's own tokenizer (asked
    for once a predd address with the `tokenizer` call): no round trip, so a stream's
    text costs predd nothing. Where the `tokenizers` package is missing or predd does
    not answer that call, `detokenize`."""
    held = _held()
    if held is None:
        return detokenize(tokens, skip_special)
    backend, vocab = held
    ids = [int(t) for t in tokens]
    if any(not 0 <= t < vocab for t in ids):
        raise LipError("EINVAL", f"detokenize.tokens: token ids must be in [0, {vocab})")
    return backend.decode(ids, skip_special_tokens=skip_special)


def encode(text: str, add_special: bool = False) -> list[int]:
    """`tokenize`'s ids, encoded in this process with predd's own tokenizer (asked for
    once a predd address with the `tokenizer` call): no round trip, so the text costs
    predd nothing and the call does not wait for a step to end. The encoding runs with
    the GIL released (the program's other threads go on). Where the `tokenizers` package
    is missing or predd does not answer that call, `tokenize`. Unlike predd's
    `tokenize`, no limit on the text's length: its cost is this process's."""
    if not isinstance(text, str) or not isinstance(add_special, bool):
        raise LipError("EINVAL", "encode: text must be a string and add_special a bool")
    held = _held()
    try:
        if held is None:
            return tokenize(text, add_special)
        return held[0].encode_batch([text], add_special_tokens=add_special)[0].ids
    except (TypeError, UnicodeEncodeError):   # tokenizers' and msgpack's refusal of a
        raise LipError("EINVAL", "encode: text is not Unicode text (a lone surrogate)") \
            from None                           # str with a lone surrogate: no UTF-8


def tokenizer():
    """predd's tokenizer as a `tokenizers.Tokenizer` held in this process (asked for once
    a predd address with the `tokenizer` call); None where the `tokenizers` package is
    missing or predd does not answer that call."""
    held = _held()
    return held[0] if held is not None else None


def _held():
    """(the tokenizer, predd's vocabulary size) held for the client's predd, or None."""
    c = client()
    held = _decoders.get(c.addr)
    if held is None:
        with _decoders_lock:           # one fetch a predd, not one a thread that asks first
            held = _decoders.get(c.addr)
            if held is None:
                backend = _decoder_of(c)
                held = _decoders[c.addr] = (backend, info_cached()["vocab_size"]) \
                    if backend else False
    return held or None


_decoders: dict[str, object] = {}     # predd address: (its tokenizer here, vocab), or False
_decoders_lock = threading.Lock()


def _decoder_of(c: Client):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    try:
        _, frames = c.request("tokenizer")
    except LipError as exc:
        if exc.code in ("ENOSYS", "EINVAL", "EOPNOTSUPP"):   # a predd without the call
            return False
        raise
    try:
        return Tokenizer.from_str(bytes(frames[0]).decode()) if len(frames) == 1 else False
    except Exception:          # noqa: BLE001 - a spec this tokenizers cannot read
        return False


def chat_template(messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template."""
    return client().call("chat_template", messages=messages,
                         add_generation_prompt=add_generation_prompt)["tokens"]


def info() -> dict:
    return _strip(client().call("info"))


def info_cached() -> dict:
    """`info()` asked once per connection (the model's facts do not change while it
    is served; pool figures in it are as of the first call). Do not modify it.
    `connect()` forgets it: the next call asks the new predd."""
    global _info
    c = client()
    cached = _info
    if cached is None or cached[0] is not c:
        cached = _info = (c, _strip(c.call("info")))
    return cached[1]


def stats() -> dict:
    return _strip(client().call("stats"))


def fsck() -> dict:
    return _strip(client().call("fsck"))


def ps() -> list[dict]:
    return client().call("ps")["sessions"]


def _strip(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("rid", "ok")}


def send_to_user(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---------------------------------------------------------------- KV objects

def _handle(reply: dict, replica: str = "") -> KV:
    return KV(reply["cap"], reply["rights"], replica=replica)


def kv_create() -> KV:
    return _handle(client().call("kv_create"))


def kv_fork(kv: KV, rights: str = "rw") -> KV:
    return _handle(client_of(kv).call("kv_fork", cap=kv.cap, rights=rights), kv.replica)


def kv_stat(kv: KV) -> dict:
    return _strip(client_of(kv).call("kv_stat", cap=kv.cap))


def kv_tokens(kv: KV, start: int = 0, end: int | None = None) -> list[int]:
    return client_of(kv).call("kv_tokens", cap=kv.cap, start=start, end=end)["tokens"]


def kv_positions(kv: KV, start: int = 0, end: int | None = None) -> list[int]:
    return client_of(kv).call("kv_tokens", cap=kv.cap, start=start, end=end)["positions"]


def kv_truncate(kv: KV, length: int) -> None:
    client_of(kv).call("kv_truncate", cap=kv.cap, length=length)


def kv_extract(kv: KV, ranges: Sequence[tuple[int, int]]) -> KV:
    return _handle(client_of(kv).call("kv_extract", cap=kv.cap,
                                      ranges=[[int(a), int(b)] for a, b in ranges]),
                   kv.replica)


def kv_merge(kvs: Sequence[KV]) -> KV:
    where = {client_of(kv) for kv in kvs}
    if len(where) > 1:
        raise LipError("EXDEV", "kv_merge: the caches are on different replicas "
                       f"({', '.join(sorted(c.addr for c in where))}); kv_open them from "
                       "one replica (the file moves) or copy one over (kv_export/kv_import)")
    c = where.pop() if where else client()
    return _handle(c.call("kv_merge", caps=[kv.cap for kv in kvs]),
                   kvs[0].replica if kvs else "")


def kv_export(kv: KV) -> bytes:
    return bytes(client_of(kv).request("kv_export", cap=kv.cap)[1][0])


def kv_import(blob: bytes) -> KV:
    return _handle(client().request("kv_import", frames=(blob,))[0])


def kv_close(kv: KV) -> None:
    """Drop a handle: an anonymous object's capability is freed; an opened file is
    closed (its cache lives on under its name)."""
    if kv.closed:
        return
    kv.closed = True
    if kv.fd is not None:
        os.close(kv.fd)
        return
    client_of(kv).call("kv_free", cap=kv.cap)


def kv_remove(kv: KV) -> None:
    """Free a cache: unlink its file if it came from one, and drop the handle."""
    if kv.path is not None:
        os.unlink(kv.path)
    kv_close(kv)


kv_free = kv_close


def _kvfs_path(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(default_mount(), path)


def kv_open(path: str, write: bool = False, create: bool = False, move: bool = True) -> KV:
    """A handle to the cache file `path` (relative paths are under $KVFS_MOUNT).
    `write=True` needs write permission and gives a read-write capability. With several
    replicas, `move=True` first brings the file to this process's replica where kvfsd
    lets it; `move=False` leaves it on its home, where the handle's calls go."""
    full = _kvfs_path(path)
    flags = (os.O_RDWR if write else os.O_RDONLY) | (os.O_CREAT if create else 0)
    if create and not os.path.exists(full):
        os.close(_create(full))
    if move:
        _bring_here(full)
    try:
        fd = os.open(full, flags, 0o644)
        data = os.pread(fd, descriptor.MAX_LEN, 0)
    except OSError as exc:
        if "fd" in locals():
            os.close(fd)
        raise LipError(_errno_name(exc), f"{full}: {exc.strerror}") from None
    try:
        desc = descriptor.parse(data)
    except ValueError as exc:
        os.close(fd)
        raise LipError("EINVAL", f"{full}: not a KV cache file ({exc})") from None
    return KV(desc.cap, desc.rights, path=full, fd=fd, replica=desc.replica)


REPLICA, REHOME = "user.kv.replica", "user.kv.rehome"
STAY = {errno.EACCES, errno.EPERM, errno.EBUSY, errno.EINVAL, errno.EIO}


def _create(full: str) -> int:
    try:
        return os.open(full, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise LipError(_errno_name(exc), f"{full}: {exc.strerror}") from None


def _bring_here(full: str) -> None:
    """Ask kvfsd to move the cache file `full` to this process's replica when it lives on
    another; where kvfsd refuses (see STAY), the cache stays where it is."""
    try:
        home = os.getxattr(full, REPLICA).decode()
    except OSError:
        return                     # no such file (open says so), or one predd only
    own = client().addr
    if home and same_endpoint_key(home) != same_endpoint_key(own):
        try:
            os.setxattr(full, REHOME, own.encode())
        except OSError as exc:
            if exc.errno not in STAY:
                raise LipError(_errno_name(exc), f"{full}: {exc.strerror}") from None


def kv_rehome(path: str, to: str = "") -> str:
    """Move the cache file `path` to the replica `to` ("": the live one with the most
    free pages; docs/scaling.md); returns its home afterwards."""
    full = _kvfs_path(path)
    try:
        os.setxattr(full, REHOME, (to or "auto").encode())
        return os.getxattr(full, REPLICA).decode()
    except OSError as exc:
        raise LipError(_errno_name(exc), f"{full}: {exc.strerror}") from None


# ---------------------------------------------------------------- memory policy

def kv_policy(kv: KV, pin: bool | None = None, evict: bool = False) -> dict:
    """Pin a cache on the device (`pin=True`, needs rw; EDQUOT past the pin quota),
    unpin it, or move it down a tier now (`evict=True`). Returns its kv_stat."""
    return _strip(client_of(kv).call("kv_policy", cap=kv.cap, pin=pin, evict=evict))


@contextmanager
def io_wait(*kvs: KV) -> Iterator[None]:
    """Say the program waits on I/O (a tool, a user) for the block: `kvs` (by default
    every handle it holds open: caches it made, forked or opened as files) are the
    first to move down a tier while it waits, and come back when it calls on them."""
    handles = list(kvs) or [kv for kv in list(_live.values()) if not kv.closed]
    by_client: dict[Client, list[KV]] = {}
    for kv in handles:
        by_client.setdefault(client_of(kv), []).append(kv)
    for c, some in by_client.items():
        c.call("io_wait", on=True, caps=[kv.cap for kv in some])
    try:
        yield
    finally:   # handles closed in the block have no capability left to name
        for c, some in by_client.items():
            c.call("io_wait", on=False, caps=[kv.cap for kv in some if not kv.closed])


def kv_save(kv: KV, path: str) -> None:
    """Publish `kv` as the file `path`: kvfsd makes it a copy-on-write fork of kv."""
    full = _kvfs_path(path)
    desc = descriptor.Descriptor(kv.cap, kv.rights, replica=client_of(kv).addr)
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, desc.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise LipError(_errno_name(exc), f"{full}: {exc.strerror}") from None


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "EIO")
