"""Starting, watching and ending one sandboxed run.

Three processes:
* the launcher (`lip run --sandbox`, root, in the host's namespaces) checks the
  request, takes a uid, plans the mounts, makes the run's cgroup, then unshares a pid
  namespace and forks the run's init. It watches the run (wall clock, the cgroup's
  CPU time and OOM kills), ends it by killing the init — the kernel then kills every
  process of the pid namespace — and turns what happened into an exit status;
* the init (pid 1 of the run, root): new mount, network and IPC namespaces, builds the
  file system (mounts.py), forks the program and reaps orphans until the program exits;
* the program (pid 2): its own session (no controlling terminal), rlimits, the run's
  uid and gid with no supplementary groups, a check that everything it needs is
  reachable by that uid, no_new_privs, Landlock, the base seccomp filter, then exec.
Any failure before exec is written to a pipe the launcher reads: the program never
runs, and the launcher reports `lip: CODE: sandbox: ...` with status 126 (127 when
the program does not exist).
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

from liblip.client import LipError
from liblip.sandbox import cgroups, identity, landlock, mounts, seccomp
from liblip.sandbox.run_limits import Limits, format_size
from symphony_protocol.stream import stream_path

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
EXIT_REFUSED, EXIT_NOT_FOUND, EXIT_TIME, EXIT_MEMORY = 126, 127, 124, 137
WATCH_S = 0.25   # how often the launcher looks at the cgroup's CPU time and OOM kills

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(LipError):
    """The run was refused or ended by the sandbox; `status` is the exit status."""

    def __init__(self, code: str, message: str, status: int = EXIT_REFUSED) -> None:
        super().__init__(code, f"sandbox: {message}")
        self.status = status


@dataclass
class Request:
    argv: list[str]
    env: dict[str, str]
    limits: Limits = field(default_factory=Limits)
    uid: int | None = None        # None: a fresh uid for this run
    kvfs_mount: str | None = None


@dataclass
class Prepared:
    """Everything the init and the program need, decided by the launcher."""
    exe: str
    argv: list[str]
    env: dict[str, str]
    uid: int
    gid: int
    covers: list[mounts.Cover]
    scratch: str
    required: list[tuple[str, int]]   # (path, os.access mode) the program must have
    executable: list[str]
    writable: list[str]
    noexec: list[str]
    limits: Limits


def package_root() -> str:
    """The directory that holds the liblip package."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _resolve_program(name: str, env: dict[str, str]) -> str:
    path = os.path.abspath(name) if "/" in name else shutil.which(
        name, path=env.get("PATH", os.defpath))
    if path is None or not os.path.exists(path):
        raise SandboxError("ENOENT", f"{name}: no such program", EXIT_NOT_FOUND)
    return path


def _ipc_path(addr: str) -> str | None:
    if addr.startswith("tcp://"):
        raise SandboxError("EINVAL", "a sandboxed LIP has no network: use an ipc:// predd "
                                     "address, not " + addr)
    return addr[len("ipc://"):] if addr.startswith("ipc://") else None


def prepare(req: Request, uid: int, gid: int) -> Prepared:
    env = dict(req.env)
    socket = _ipc_path(env.get("PREDD_ADDR", ""))
    program = _resolve_program(req.argv[0], env)
    python = [sys.executable, sys.prefix, sys.base_prefix, os.path.dirname(os.__file__),
              package_root()]
    required = [(sys.executable, os.X_OK)] + [(p, os.R_OK | os.X_OK) for p in python[1:]]
    if program.endswith(".py"):
        exe, argv = sys.executable, [sys.executable, "-c", seccomp.BOOTSTRAP, program,
                                     *req.argv[1:]]
        required.append((program, os.R_OK))
    else:
        exe, argv = program, [program, *req.argv[1:]]
        required.append((program, os.X_OK))
    stream = stream_path(env.get("PREDD_ADDR", "")) if socket else None
    optional = [p for p in [socket, stream, req.kvfs_mount, *req.argv[1:]]
                if p and os.path.isabs(p) and os.path.lexists(p)]
    try:
        covers = mounts.plan([p for p, _ in required] + optional, mounts.hidden_dirs(),
                             mounts.host_blocked(uid, gid), mounts.host_readlink)
        scratch = mounts.scratch_path(covers, uid)
    except OSError as exc:
        raise SandboxError("EPERM", f"cannot lay out the run's file system: {exc}") from None
    kvfs = [req.kvfs_mount] if req.kvfs_mount and os.path.isdir(req.kvfs_mount) else []
    env.update(HOME=scratch, TMPDIR=scratch, PWD=scratch,
               PYTHONPATH=os.pathsep.join(filter(None, [package_root(),
                                                        env.get("PYTHONPATH")])))
    for name, value in (("MALLOC_ARENA_MAX", "2"), ("OMP_NUM_THREADS", "1"),
                        ("OPENBLAS_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1")):
        env.setdefault(name, value)   # threads and arenas within the process limits
    executable = [*landlock.SYSTEM_EXEC_DIRS, sys.prefix, sys.base_prefix,
                  os.path.dirname(os.path.realpath(sys.executable)), program]
    return Prepared(exe, argv, env, uid, gid, covers, scratch, required, executable,
                    [scratch, *kvfs], kvfs, req.limits)


# ---------------------------------------------------------------- the launcher

class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _stop(signum, _frame):
    raise _Stopped(signum)


def run(req: Request) -> int:
    """Run `req` sandboxed; the program's exit status (128+N if killed by signal N).
    Raises SandboxError when the run is refused or ended by a limit."""
    if os.geteuid() != 0:
        raise SandboxError("EPERM", "lip run --sandbox needs root (to switch to the run's "
                                    "uid and build its namespaces)")
    problems = req.limits.problems()
    if problems:
        raise SandboxError("EINVAL", "; ".join(problems))
    if not req.argv:
        raise SandboxError("EINVAL", "no program to run")
    if landlock.abi_version() < 1:
        raise SandboxError("EPERM", "cannot confine: Landlock is not available on this "
                                    "kernel (Linux >= 5.13 with landlock in lsm=)")
    try:
        who = identity.fixed(req.uid) if req.uid is not None else identity.fresh()
    except OSError as exc:
        raise SandboxError(errno.errorcode.get(exc.errno, "EPERM"), str(exc.strerror))
    try:
        prep = prepare(req, who.uid, who.gid)
        group = cgroups.RunCgroup.create(f"run-{who.uid}-{os.getpid()}", req.limits.memory,
                                         req.limits.max_procs + 1)   # + the run's init
        try:
            return _launch(prep, group)
        finally:
            group.kill()
            for path in group.remove():
                print(f"lip: EBUSY: sandbox: could not remove cgroup {path}",
                      file=sys.stderr, flush=True)
    finally:
        who.release()


def _launch(prep: Prepared, group: cgroups.RunCgroup) -> int:
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")   # for our next child
    pid = os.fork()
    if pid == 0:
        _init(prep, err_w, go_r, (err_r, go_w))
    os.close(err_w)
    os.close(go_r)
    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            group.attach(pid)
        except OSError as exc:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise SandboxError("EPERM", f"cannot move the run into its cgroup: {exc}")
        os.write(go_w, b"g")
        os.close(go_w)
        return _supervise(prep, pid, err_r, group)
    except _Stopped as stop:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except ChildProcessError:   # already reaped
            pass
        return 128 + stop.signum
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        os.close(err_r)


def _supervise(prep: Prepared, pid: int, err_r: int, group: cgroups.RunCgroup) -> int:
    limits = prep.limits
    deadline = time.monotonic() + limits.wall_seconds
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(err_r, select.POLLIN)
    report, reason = b"", None
    watch = group.cpu is not None or group.memory is not None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = "wall"
                break
            events = poller.poll(1000 * (min(left, WATCH_S) if watch else left))
            exited = False
            for fd, _ in events:
                if fd == err_r:
                    chunk = os.read(err_r, 4096)
                    report += chunk
                    if not chunk:
                        poller.unregister(err_r)
                else:
                    exited = True
            if exited:
                break
            if group.oom_kills():
                reason = "memory"
                break
            used = group.cpu_seconds()
            if used is not None and used >= limits.cpu_seconds:
                reason = "cpu"
                break
        if reason:
            os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
    finally:
        os.close(pidfd)
    report += _drain(err_r)
    if report:
        code, status_text, message = report.decode(errors="replace").split(" ", 2)
        raise SandboxError(code, message.strip(), int(status_text))
    code = os.waitstatus_to_exitcode(status)
    code = code if code >= 0 else 128 - code
    if reason is None and group.oom_kills():
        reason = "memory"
    if reason is None and (code == 128 + signal.SIGXCPU or code == 128 + signal.SIGKILL
                           and usage.ru_utime + usage.ru_stime >= limits.cpu_seconds):
        reason = "cpu"
    if reason == "wall":
        raise SandboxError("ETIME", f"wall time limit ({limits.wall_seconds} s) reached",
                           EXIT_TIME)
    if reason == "cpu":
        raise SandboxError("ETIME", f"cpu time limit ({limits.cpu_seconds} s) reached",
                           EXIT_TIME)
    if reason == "memory":
        raise SandboxError("ENOMEM", f"memory limit ({format_size(limits.memory)}) reached",
                           EXIT_MEMORY)
    return code


def _drain(fd: int) -> bytes:
    out = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 4096):
            out += chunk
    except BlockingIOError:
        pass
    return out


# ---------------------------------------------------------------- inside the run

def _fail(err_w: int, exc: BaseException) -> None:
    """Tell the launcher why the program will not run, then leave."""
    if isinstance(exc, SandboxError):
        code, status, message = exc.code, exc.status, exc.message.removeprefix("sandbox: ")
    elif isinstance(exc, OSError):
        code = errno.errorcode.get(exc.errno or 0, "EIO")
        status = EXIT_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_REFUSED
        message = str(exc)
    else:
        code, status, message = "EIO", EXIT_REFUSED, f"{type(exc).__name__}: {exc}"
    try:
        os.write(err_w, f"{code} {status} {message}".encode())
    finally:
        os._exit(status)


def _init(prep: Prepared, err_w: int, go_r: int, launcher_ends: tuple[int, int]) -> None:
    try:
        for fd in launcher_ends:
            os.close(fd)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        if os.read(go_r, 1) != b"g":   # the launcher gave up (or died)
            os._exit(EXIT_REFUSED)
        os.close(go_r)
        os.setsid()
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC), "unshare")
        mounts.build(prep.covers, prep.scratch, prep.uid, prep.gid, prep.limits.memory,
                     prep.noexec)
        child = os.fork()
        if child == 0:
            _program(prep, err_w)
        os.close(err_w)
    except BaseException as exc:   # noqa: BLE001 - anything: report it, never run the program
        _fail(err_w, exc)
    while True:   # pid 1: reap orphans; end (and so end the namespace) with the program
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _program(prep: Prepared, err_w: int) -> None:
    try:
        os.setsid()
        os.setgroups([])
        os.setresgid(prep.gid, prep.gid, prep.gid)
        os.setresuid(prep.uid, prep.uid, prep.uid)
        for path, mode in prep.required:
            if not os.access(path, mode):
                need = {os.X_OK: "execute", os.R_OK: "read"}.get(mode, "read and search")
                raise SandboxError("EPERM", f"uid {prep.uid} cannot {need} {path}: refusing "
                                            "to run (cannot confine without it)")
        os.chdir(prep.scratch)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        landlock.restrict(landlock.Policy(landlock.readable_roots(), prep.executable,
                                          prep.writable))
        seccomp.install(seccomp.base_program())
        os.closerange(3, err_w)
        os.closerange(err_w + 1, 1 << 16)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        prep.limits.apply_rlimits()   # last: this Python may already be near RLIMIT_AS
        os.execve(prep.exe, prep.argv, prep.env)
    except BaseException as exc:   # noqa: BLE001
        _fail(err_w, exc)
