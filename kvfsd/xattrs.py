"""Which extended attributes a kvfs node has, and their bounds.

* `user.kv.tokens/bytes/pages/model/tier/replica`: computed from predd's figures (files
  only), read-only (EPERM). `tier` is where predd keeps the cache's lowest page: device,
  host or disk; `replica` the address of the predd holding it (its home).
* `user.kv.replicas` and `user.kv.migrations`: computed, on the mount's root only,
  read-only (EPERM).
* `user.kv.pin` (0 or 1) and `user.kv.ttl` (whole seconds): policy, stored (files only),
  carried out by kvfsd/policy.py and kvfsd/expiry.py.
* `user.kv.evict` (1) and `user.kv.rehome` (a replica's address, `auto` or empty):
  actions (files only), carried out and never stored.
* Any other `user.kv.*`, and any name outside `user.*`: EOPNOTSUPP.
* Any other `user.*`: the application's own (mount_examples/rag_cache.py keeps its hit
  counts there), at most `APP_MAX` per node (ENOSPC beyond).
Names and values are at most 64 bytes (E2BIG): a node's xattrs are bounded, and with
the names a uid may own, so is what one user can make kvfsd store.
"""
from __future__ import annotations

import errno

from symphony_protocol import descriptor
KV_PREFIX = b"user.kv."
REPLICA = b"user.kv.replica"
COMPUTED = (b"user.kv.tokens", b"user.kv.bytes", b"user.kv.pages", b"user.kv.model",
            b"user.kv.tier", REPLICA)
REPLICAS, MIGRATIONS = b"user.kv.replicas", b"user.kv.migrations"
ROOT_COMPUTED = (REPLICAS, MIGRATIONS)     # the mount root's
READ_ONLY = COMPUTED + ROOT_COMPUTED
PIN, TTL, EVICT, REHOME = b"user.kv.pin", b"user.kv.ttl", b"user.kv.evict", b"user.kv.rehome"
POLICY = (PIN, TTL)        # stored
ACTIONS = (EVICT, REHOME)  # done, not stored
NAME_MAX = 64          # bytes, "user." included
VALUE_MAX = 64         # bytes
ADDR_MAX = descriptor.ADDR_MAX   # user.kv.rehome's value: a replica's address
APP_MAX = 8            # application attributes per file or directory


def _err(code: int, what: str) -> OSError:
    return OSError(code, f"{errno.errorcode[code]}: {what}")


def _show(name: bytes) -> str:
    return name[:64].decode("utf-8", "backslashreplace")


def check(name: bytes, value: bytes) -> None:
    """Whether `name` may be set to `value` (OSError if not): in user.kv.* only the policy
    names, with well-formed values; elsewhere in user.* short names and values. Checked
    before anything is stored (the room on a node is `check_room`'s)."""
    if name in READ_ONLY:
        raise _err(errno.EPERM, f"{_show(name)} is read-only")
    if not name.startswith(b"user.") or (name.startswith(KV_PREFIX)
                                         and name not in POLICY + ACTIONS):
        raise _err(errno.EOPNOTSUPP, f"{_show(name)}: not supported")
    if len(name) > NAME_MAX or len(value) > (ADDR_MAX if name == REHOME else VALUE_MAX):
        raise _err(errno.E2BIG, f"{_show(name)}: name or value over "
                   f"{NAME_MAX}/{VALUE_MAX} bytes")
    text = value.strip()
    if name == PIN and text not in (b"0", b"1"):
        raise _err(errno.EINVAL, "user.kv.pin is 0 or 1")
    if name == TTL and not (text.isdigit() and text.isascii()):
        raise _err(errno.EINVAL, "user.kv.ttl is a whole number of seconds")
    if name == EVICT and text != b"1":
        raise _err(errno.EINVAL, "user.kv.evict is 1")
    if name == REHOME and text not in (b"", b"auto") \
            and not descriptor.valid_replica(text.decode("ascii", "replace")):
        raise _err(errno.EINVAL, "user.kv.rehome is a replica's address, auto or empty")


def _valid(name: bytes, value: bytes) -> bool:
    try:
        check(name, value)
    except OSError:
        return False
    return True


def check_room(existing: dict[bytes, bytes], name: bytes, is_file: bool) -> None:
    """Whether a node with `existing` xattrs may take `name` (after `check`)."""
    if name in POLICY + ACTIONS and not is_file:
        raise _err(errno.EOPNOTSUPP, f"{_show(name)}: cache files only")
    if not name.startswith(KV_PREFIX) and name not in existing \
            and sum(not n.startswith(KV_PREFIX) for n in existing) >= APP_MAX:
        raise _err(errno.ENOSPC, f"at most {APP_MAX} application attributes")


def loaded(stored: dict[bytes, bytes], is_file: bool) -> dict[bytes, bytes]:
    """The xattrs of a stored node that are still allowed (a state written before these
    bounds may hold more: the excess is dropped)."""
    valid = [(k, v) for k, v in stored.items() if _valid(k, v) and k not in ACTIONS]
    policy = [(k, v) for k, v in valid if k.startswith(KV_PREFIX)
              and (k not in POLICY or is_file)]
    app = [(k, v) for k, v in valid if not k.startswith(KV_PREFIX)][:APP_MAX]
    return dict(policy + app)
