"""Landlock for sandboxed runs: what the program may read, write and execute.

A `Policy` lists paths with the rights granted beneath them; everything the kernel's
ABI can restrict is handled, so anything not granted is denied (EACCES):
* read (files and directories) beneath `readable` — the whole tree but /dev, plus
  the few harmless device nodes;
* execute only beneath `executable`: the system's read-only binary and library
  directories, the Python install, the program itself — never the scratch dir or
  the KVFS mount, so a program cannot run a file it wrote;
* write only beneath `writable` (the scratch dir, the KVFS mount) and /dev/null;
* ABI >= 4: no TCP bind/connect at all; ABI >= 5: no ioctl on device files opened
  after the restriction; ABI >= 6: no signals to, and no abstract unix sockets of,
  processes outside the run.
`restrict(policy)` applies it to the calling thread and its future children, for good.
"""
from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass, field

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446   # all architectures
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

READ = READ_FILE | READ_DIR
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV   # valid on a file
WRITE = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK
         | MAKE_FIFO | MAKE_SYM | REFER | TRUNCATE)

DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
SYSTEM_EXEC_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_libc = ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The kernel's Landlock ABI (0 when Landlock is absent or disabled)."""
    version = _libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    return max(version, 0)


def handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


@dataclass
class Policy:
    readable: list[str] = field(default_factory=list)
    executable: list[str] = field(default_factory=list)
    writable: list[str] = field(default_factory=list)

    def rules(self, abi: int) -> list[tuple[str, int]]:
        """(path, rights) pairs for this ABI; paths that do not exist are left out."""
        handled = handled_fs(abi)
        rules = [(p, READ) for p in self.readable]
        rules += [(p, READ | EXECUTE) for p in self.executable]
        rules += [(p, WRITE | READ) for p in self.writable]
        rules += [(d, READ_FILE | WRITE_FILE | TRUNCATE) if d in ("/dev/null", "/dev/zero",
                  "/dev/full") else (d, READ_FILE) for d in DEVICES]
        return [(p, r & handled) for p, r in rules if os.path.exists(p)]


def readable_roots(root: str = "/") -> list[str]:
    """Every entry of / but /dev (device nodes get rules one by one)."""
    return [os.path.join(root, name) for name in sorted(os.listdir(root)) if name != "dev"]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock: {what}: {os.strerror(err)}")
    return result


def restrict(policy: Policy) -> int:
    """Apply `policy` to this thread (no_new_privs must be set); the ABI used."""
    abi = abi_version()
    if abi < 1:
        raise OSError(95, "Landlock is not available on this kernel (Linux >= 5.13 with "
                          "landlock in the lsm= list)")
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", handled_fs(abi), net, scoped)
    attr = attr[:24 if abi >= 6 else 16 if abi >= 4 else 8]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(_libc.syscall(SYS_CREATE_RULESET, buf, len(attr), 0), "create_ruleset")
    try:
        for path, rights in policy.rules(abi):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    rights &= FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                _check(_libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, rule, 0),
                       f"add_rule {path}")
            finally:
                os.close(fd)
        _check(_libc.syscall(SYS_RESTRICT_SELF, ruleset, 0), "restrict_self")
    finally:
        os.close(ruleset)
    return abi
