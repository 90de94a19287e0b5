"""Server-side handling of secrets and transports: loopback hosts, private files of
tokens and keys, constant-time matching of a secret."""
from __future__ import annotations

import hmac
from typing import Any


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
