"""Who is on the other end of a message: kernel credentials on ipc, keys on tcp.

Rules (docs/identity.md has the reasoning):
* ipc: libzmq reads the peer's SO_PEERCRED when it connects, and every frame it
  delivers carries `Peer-Address` = "localhost:UID:GID:PID". That is the only source
  of an ipc peer's uid and pid; what a client declares in `hello` is checked against it.
* tcp: the peer's uid is unknown. Without auth keys predd binds tcp only on loopback
  and every tcp peer is `NOBODY`. With keys (`--auth-keys FILE`), a tcp peer has no
  session until a `hello` carries a token from the file; the token names its uid.
* Trusted: an ipc peer whose kernel uid is predd's own euid (kvfsd, the operator).
  Never a tcp peer, whatever its token says: its uid is not the kernel's word.
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from symphony_protocol import ProtocolError, is_loopback_host, match_secret, read_private_file

NOBODY = 65534
MAX_UID = 2**32 - 2          # (uid_t)-1 is "no uid" to the kernel
MIN_TOKEN_LEN = 16


@dataclass(frozen=True)
class Peer:
    """The sender of one message, as the transport vouches for it."""
    address: str             # the raw Peer-Address ("localhost:0:0:123", "127.0.0.1")
    uid: int | None = None   # kernel uid (ipc); None when the transport cannot tell
    gid: int | None = None
    pid: int | None = None

    @property
    def kernel(self) -> bool:
        """Whether the kernel vouches for uid and pid."""
        return self.uid is not None


def peer_of(transport: str, address: str | None) -> Peer:
    """The Peer for a frame's Peer-Address on a socket bound to `transport`."""
    address = address or ""
    if transport == "ipc":
        parts = address.split(":")
        if len(parts) == 4 and parts[0] == "localhost" and all(
                p.isdigit() for p in parts[1:]):
            uid, gid, pid = (int(p) for p in parts[1:])
            return Peer(address, uid, gid, pid)
    return Peer(address)     # no credentials: treated like an unauthenticated tcp peer


def identify(peer: Peer, token: str | None, keys: AuthKeys | None) -> tuple[int, int, str]:
    """(uid, pid, how the uid is known) for a new session of `peer` whose first request
    is a hello with `token` (None: not a hello). EACCES on an unauthenticated request to
    an endpoint with keys."""
    if peer.kernel:
        return peer.uid, peer.pid, "kernel"
    if keys is None:
        return NOBODY, 0, "nobody"
    if not token:
        raise ProtocolError("EACCES", "this endpoint needs authentication: the first "
                            "request must be hello with a token")
    uid = keys.uid_of(token)
    if uid is None:
        raise ProtocolError("EACCES", "hello: unknown token")
    return uid, 0, "token"


def transport_of(addr: str) -> str:
    return addr.split("://", 1)[0] if "://" in addr else ""


def is_loopback(addr: str) -> bool:
    """Whether a tcp:// endpoint listens on loopback only ("*" and names are not)."""
    return is_loopback_host(urlsplit(addr).hostname or "")


class AuthKeys:
    """Tokens that name uids for tcp peers: lines `TOKEN UID [trusted] [comment]`, `#`
    comments. `trusted` (only with UID = predd's own euid) makes the session trusted, as
    kvfsd is on ipc: how one kvfsd keeps the files of a predd replica on another host.

    The file holds secrets, so it must be a regular file readable by its owner only
    (no group or other bits) and owned by predd's euid or root; anything else is refused.
    """

    def __init__(self, keys: list[tuple[bytes, int]], trusted: list[bytes] = ()) -> None:
        self._keys = keys
        self._trusted = [(t, True) for t in trusted]

    def __len__(self) -> int:
        return len(self._keys)

    @classmethod
    def load(cls, path: str, own_uid: int | None = None) -> AuthKeys:
        """Parse the keys file; ValueError with a message that names the problem."""
        own_uid = os.geteuid() if own_uid is None else own_uid
        text = read_private_file(path, "--auth-keys")
        keys: list[tuple[bytes, int]] = []
        trusted: list[bytes] = []
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split(None, 3)
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) < 2 or not fields[1].isdigit() or int(fields[1]) > MAX_UID:
                raise ValueError(f"--auth-keys {path}:{n}: expected "
                                 "`TOKEN UID [trusted] [comment]`")
            if len(fields[0]) < MIN_TOKEN_LEN:
                raise ValueError(f"--auth-keys {path}:{n}: token shorter than "
                                 f"{MIN_TOKEN_LEN} characters")
            token = fields[0].encode()
            if any(hmac.compare_digest(token, t) for t, _ in keys):
                raise ValueError(f"--auth-keys {path}:{n}: token listed twice")
            keys.append((token, int(fields[1])))
            if len(fields) > 2 and fields[2] == "trusted":
                if int(fields[1]) != own_uid:
                    raise ValueError(f"--auth-keys {path}:{n}: a trusted token must name "
                                     f"predd's own uid {own_uid}, not {fields[1]}")
                trusted.append(token)
        if not keys:
            raise ValueError(f"--auth-keys {path}: no keys")
        return cls(keys, trusted)

    def uid_of(self, token: str) -> int | None:
        """The uid a token names, or None (constant time: see match_secret)."""
        return match_secret(self._keys, token)

    def trusts(self, token: str) -> bool:
        """Whether `token` is a trusted one (constant time)."""
        return bool(match_secret(self._trusted, token))


def check_endpoint(addr: str, keys: AuthKeys | None) -> None:
    """Refuse (ValueError) an endpoint predd must not serve: a transport other than
    ipc and tcp, or tcp off loopback without auth keys (anyone could connect)."""
    transport = transport_of(addr)
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"--addr {addr}: only ipc:// and tcp:// are served")
    if transport == "tcp" and keys is None and not is_loopback(addr):
        raise ValueError(f"--addr {addr}: tcp off loopback needs --auth-keys FILE "
                         "(the uid of a tcp peer is unknown)")
