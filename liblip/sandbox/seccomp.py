"""seccomp filters for sandboxed runs, assembled as classic BPF.

Two filters, stacked:
* `base_program()` — every sandboxed process, whatever it executes: sockets only
  AF_UNIX (others EACCES); no TIOCSTI/TIOCLINUX ioctls; no memfd_create, ptrace,
  mount or namespace calls (unshare, setns, clone with CLONE_NEW*), keyrings, bpf,
  perf, kernel modules, kexec, io_uring (it would bypass this filter) — all EPERM;
  clone3 is ENOSYS (its flags sit behind a pointer a filter cannot read, and libc
  falls back to clone); x32 and foreign-architecture calls are refused.
* `strict_program()` — added on top for Python LIPs (`lip run --sandbox prog.py`)
  by BOOTSTRAP just before the program's first line: no exec and no fork (EPERM);
  threads (clone with CLONE_THREAD) are fine.
A filter is a list of (code, jt, jf, k) instructions; `install` loads one for good
(no_new_privs first, so it needs no privilege).
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

# BPF opcodes (linux/filter.h) and seccomp return values.
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
RET_ERRNO = 0x00050000
OFF_NR, OFF_ARCH = 0, 4


def OFF_ARG(i: int) -> int:   # low 32 bits of args[i] (little-endian)
    return 16 + 8 * i


X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_THREAD = 0x00010000
CLONE_NEW_ANY = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                 | 0x20000000 | 0x40000000 | 0x00000080)   # NEWNS UTS IPC USER PID NET CGROUP TIME

Instr = tuple[int, int, int, int]


class Arch:
    def __init__(self, audit: int, x32: bool, numbers: dict[str, int]) -> None:
        self.audit, self.x32, self.numbers = audit, x32, numbers


_COMMON = {   # asm-generic numbers, the same on every architecture since 5.x
    "pidfd_getfd": 438, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435, "process_madvise": 440,
    "mount_setattr": 442, "quotactl_fd": 443, "memfd_secret": 447, "open_tree_attr": 467,
}
ARCHES = {
    "x86_64": Arch(0xC000003E, True, {
        **_COMMON, "ioctl": 16, "socket": 41, "clone": 56, "fork": 57, "vfork": 58,
        "execve": 59, "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135,
        "vhangup": 153, "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165,
        "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172,
        "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179,
        "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248, "request_key": 249,
        "keyctl": 250, "unshare": 272, "perf_event_open": 298, "fanotify_init": 300,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
        "memfd_create": 319, "kexec_file_load": 320, "bpf": 321, "execveat": 322,
        "userfaultfd": 323}),
    "aarch64": Arch(0xC00000B7, False, {
        **_COMMON, "lookup_dcookie": 18, "ioctl": 29, "umount2": 39, "mount": 40,
        "pivot_root": 41, "chroot": 51, "vhangup": 58, "quotactl": 60, "acct": 89,
        "personality": 92, "unshare": 97, "kexec_load": 104, "init_module": 105,
        "delete_module": 106, "syslog": 116, "ptrace": 117, "reboot": 142, "socket": 198,
        "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220, "execve": 221,
        "swapon": 224, "swapoff": 225, "perf_event_open": 241, "fanotify_init": 262,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "setns": 268,
        "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "finit_module": 273,
        "memfd_create": 279, "bpf": 280, "execveat": 281, "userfaultfd": 282,
        "kexec_file_load": 294}),
}

DENIED = (   # EPERM for any program: escapes, other processes' memory, kernel surfaces
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "process_madvise", "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "name_to_handle_at", "open_by_handle_at", "keyctl", "add_key",
    "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "memfd_create", "memfd_secret",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "iopl", "ioperm", "swapon",
    "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "uselib", "personality",
    "lookup_dcookie", "vhangup", "syslog", "fanotify_init",
)


def ret_errno(code: int) -> int:
    return RET_ERRNO | code


def _deny(nr: int, code: int) -> list[Instr]:
    return [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, ret_errno(code))]


def _on_arg(nr: int, arg: int, tests: list[tuple[int, int, int]], default: int) -> list[Instr]:
    """If the call is `nr`: load args[arg] (low word), return the action of the first
    (opcode, value, action) test that matches, else `default`."""
    body: list[Instr] = [(LD_W_ABS, 0, 0, OFF_ARG(arg))]
    for op, value, action in tests:
        body += [(op, 0, 1, value), (RET_K, 0, 0, action)]
    body.append((RET_K, 0, 0, default))
    return [(JEQ_K, 0, len(body), nr), *body]


def _prologue(arch: Arch) -> list[Instr]:
    prog = [(LD_W_ABS, 0, 0, OFF_ARCH), (JEQ_K, 1, 0, arch.audit),
            (RET_K, 0, 0, RET_KILL_PROCESS), (LD_W_ABS, 0, 0, OFF_NR)]
    if arch.x32:
        prog += [(JGE_K, 0, 1, X32_SYSCALL_BIT), (RET_K, 0, 0, ret_errno(errno.ENOSYS))]
    return prog


def base_program(arch_name: str | None = None) -> list[Instr]:
    arch = ARCHES[arch_name or platform.machine()]
    nr = arch.numbers
    prog = _prologue(arch)
    for name in DENIED:
        if name in nr:
            prog += _deny(nr[name], errno.EPERM)
    prog += _deny(nr["clone3"], errno.ENOSYS)
    prog += _on_arg(nr["clone"], 0, [(JSET_K, CLONE_NEW_ANY, ret_errno(errno.EPERM))],
                    RET_ALLOW)
    prog += _on_arg(nr["socket"], 0, [(JEQ_K, AF_UNIX, RET_ALLOW)], ret_errno(errno.EACCES))
    prog += _on_arg(nr["ioctl"], 1, [(JEQ_K, TIOCSTI, ret_errno(errno.EPERM)),
                                      (JEQ_K, TIOCLINUX, ret_errno(errno.EPERM))], RET_ALLOW)
    prog.append((RET_K, 0, 0, RET_ALLOW))
    return prog


def strict_program(arch_name: str | None = None) -> list[Instr]:
    arch = ARCHES[arch_name or platform.machine()]
    nr = arch.numbers
    prog = _prologue(arch)
    for name in ("execve", "execveat", "fork", "vfork"):
        if name in nr:
            prog += _deny(nr[name], errno.EPERM)
    prog += _deny(nr["clone3"], errno.ENOSYS)
    prog += _on_arg(nr["clone"], 0, [(JSET_K, CLONE_THREAD, RET_ALLOW)], ret_errno(errno.EPERM))
    prog.append((RET_K, 0, 0, RET_ALLOW))
    return prog


def install(prog: list[Instr]) -> None:
    """Load `prog` for this thread and its future children, irrevocably."""
    libc = ctypes.CDLL(None, use_errno=True)
    raw = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))
    fprog = ctypes.create_string_buffer(struct.pack("=HxxxxxxQ", len(prog),
                                                    ctypes.addressof(raw)))
    for args, what in (((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs"),
                       ((PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0), "seccomp")):
        if libc.prctl(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {errno.errorcode.get(err, err)}")


def lock_python_program() -> None:
    """Called by BOOTSTRAP: the Python LIP may not fork or exec from here on."""
    install(strict_program())


# Runs `python -c BOOTSTRAP PROGRAM ARGS...`: strict filter, then the program as
# __main__ with sys.argv and sys.path[0] as `python PROGRAM ARGS...` would set them.
BOOTSTRAP = ("import os, runpy, sys; from liblip.sandbox.seccomp import lock_python_program; "
             "lock_python_program(); sys.argv = sys.argv[1:]; "
             "sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0])); "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
