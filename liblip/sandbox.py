"""`lip run --sandbox`: start a LIP as an untrusted process.

The child gets, before the program's first instruction:
* its own uid and gid (a fresh unprivileged id, no supplementary groups) and a scratch
  directory it owns ($HOME and $TMPDIR point there). When the Python it needs is not
  readable by other users (a pyenv under /root, say), it stays uid 0 but with every
  capability dropped for good (bounding set, securebits), and says so;
* rlimits (open files, address space, file size, processes, no core dumps);
* no_new_privs;
* an empty network namespace: no network at all (predd's ipc socket is a file, so it
  still reaches predd; a tcp:// predd is refused up front);
* Landlock: the whole file system read-only (and executable), writable only in the
  scratch directory and the KVFS mount;
* seccomp (Python programs, installed by a bootstrap just before the program runs):
  no exec, no fork (threads are fine), no sockets but AF_UNIX.
Linux x86_64 or aarch64, as root (to switch uid and unshare).
"""
from __future__ import annotations

import ctypes
import os
import platform
import resource
import shutil
import struct
import sys
import tempfile

CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
UID_BASE = 200000

# Landlock (ABI >= 1): rights we handle, and the read-only subset.
LL_EXECUTE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 2, 1 << 3
LL_ALL_V1 = (1 << 13) - 1
LL_EXTRA = {2: 1 << 13, 3: 1 << 14, 5: 1 << 15}   # REFER, TRUNCATE, IOCTL_DEV by ABI

SYSCALLS = {   # arch: (audit arch, execve, execveat, fork, vfork, clone, clone3, socket)
    "x86_64": (0xC000003E, 59, 322, 57, 58, 56, 435, 41),
    "aarch64": (0xC00000B7, 221, 281, None, None, 220, 435, 198),
}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


# ---------------------------------------------------------------- Landlock

def landlock(writable: list[str]) -> None:
    abi = _libc.syscall(444, None, 0, 1)          # landlock_create_ruleset(VERSION)
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock is not available on this kernel")
    handled = LL_ALL_V1
    for version, bit in LL_EXTRA.items():
        if abi >= version:
            handled |= bit
    attr = struct.pack("=QQQ", handled, 0, 0)[: 8 if abi < 4 else 24]
    buf = ctypes.create_string_buffer(attr)
    ruleset = _check(_libc.syscall(444, buf, len(attr), 0), "landlock_create_ruleset")
    try:
        rules = [("/", LL_EXECUTE | LL_READ_FILE | LL_READ_DIR)]
        rules += [(path, handled) for path in writable]
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd))
                _check(_libc.syscall(445, ruleset, 1, rule, 0), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        _check(_libc.syscall(446, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------- seccomp

def seccomp_filter() -> None:
    """No exec, no fork (clone without CLONE_THREAD), sockets only AF_UNIX."""
    arch, execve, execveat, fork, vfork, clone, clone3, socket = SYSCALLS[platform.machine()]
    ld_w, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    deny = lambda errno_: 0x00050000 | errno_   # noqa: E731  SECCOMP_RET_ERRNO
    prog = [(ld_w, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld_w, 0, 0, 0)]
    for nr in (execve, execveat, fork, vfork):
        if nr is not None:
            prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny(1))]            # EPERM
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, deny(38))]              # ENOSYS: use clone
    prog += [(jeq, 0, 4, clone), (ld_w, 0, 0, 16), (jset, 1, 0, 0x00010000),
             (ret, 0, 0, deny(1)), (ret, 0, 0, allow)]                # CLONE_THREAD only
    prog += [(jeq, 0, 4, socket), (ld_w, 0, 0, 16), (jeq, 1, 0, 1),   # AF_UNIX
             (ret, 0, 0, deny(13)), (ret, 0, 0, allow)]               # EACCES
    prog += [(ret, 0, 0, allow)]
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(raw)
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(filt))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER,
                       ctypes.create_string_buffer(fprog), 0, 0), "seccomp")


BOOTSTRAP = ("import runpy, sys; from liblip.sandbox import seccomp_filter; "
             "seccomp_filter(); sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")


# ---------------------------------------------------------------- identity

def reachable_by_others(paths: list[str]) -> bool:
    """Whether a uid that owns nothing here can read and traverse to `paths`."""
    for path in paths:
        path = os.path.realpath(path)
        parts = path.split(os.sep)
        for i in range(2, len(parts) + 1):
            st = os.stat(os.sep.join(parts[:i]) or os.sep)
            need = 0o005 if os.path.isdir(os.sep.join(parts[:i])) else 0o004
            if st.st_mode & need != need:
                return False
    return True


def drop_all_capabilities() -> None:
    """uid 0 without any capability, unable to regain one (even through exec)."""
    secure = 0x01 | 0x02 | 0x04 | 0x08 | 0x10 | 0x20   # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (+locks)
    _check(_libc.prctl(28, secure, 0, 0, 0), "securebits")              # PR_SET_SECUREBITS
    cap = 0
    while _libc.prctl(24, cap, 0, 0, 0) == 0:                           # PR_CAPBSET_DROP
        cap += 1
    _libc.prctl(47, 4, 0, 0, 0)                                         # ambient: clear all
    header = ctypes.create_string_buffer(struct.pack("=Ii", 0x20080522, 0))
    data = ctypes.create_string_buffer(bytes(24))                        # all sets empty
    _check(_libc.syscall(126 if platform.machine() == "x86_64" else 91, header, data),
           "capset")


# ---------------------------------------------------------------- the launch

def run(argv: list[str], env: dict[str, str], kvfs_mount: str) -> int:
    """Run argv sandboxed; its exit status (128+signal if killed)."""
    if os.geteuid() != 0:
        raise PermissionError("lip run --sandbox needs root (to switch uid and unshare)")
    if env.get("PREDD_ADDR", "").startswith("tcp://"):
        raise ValueError("a sandboxed LIP has no network: use an ipc:// predd address")
    needs = [sys.executable, os.path.dirname(os.__file__), _package_root()]
    own_uid = reachable_by_others(needs)
    if not own_uid:
        print("lip: sandbox: the Python install is not readable by other users; running "
              "as uid 0 with every capability dropped", file=sys.stderr)
    uid = UID_BASE + os.getpid() % 100000 if own_uid else 0
    scratch = tempfile.mkdtemp(prefix="lip-sandbox-")
    os.chown(scratch, uid, uid)
    writable = [scratch] + ([kvfs_mount] if os.path.isdir(kvfs_mount) else [])
    if argv[0].endswith(".py"):
        argv = [sys.executable, "-c", BOOTSTRAP, *argv]
    env = {**env, "HOME": scratch, "TMPDIR": scratch,
           "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(),
                                                       env.get("PYTHONPATH")]))}
    pid = os.fork()
    if pid == 0:   # child: lock down, then exec
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            for limit, value in ((resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0),
                                 (resource.RLIMIT_AS, 16 << 30), (resource.RLIMIT_NPROC, 512),
                                 (resource.RLIMIT_FSIZE, 1 << 30)):
                resource.setrlimit(limit, (value, value))
            if own_uid:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            else:
                drop_all_capabilities()
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
            landlock(writable)
            os.chdir(scratch)
            os.execvpe(argv[0], argv, env)
        except BaseException as exc:   # noqa: BLE001 - report and leave the child
            print(f"lip: sandbox: {exc}", file=sys.stderr, flush=True)
            os._exit(126)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
