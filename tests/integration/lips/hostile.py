"""A hostile program for the sandbox tests: each argument names an attack; for each it
prints `NAME ok` (the attack worked) or `NAME ERRNO-NAME` (it was refused).
Runs as a Python LIP (`lip run --sandbox hostile.py ...`, no fork/no exec) and as a
plain program (`lip run --sandbox -- python hostile.py ...`).

Arguments with a value are NAME=VALUE (a path, a pid); absolute paths among the
arguments are not attacks (the sandbox exposes such arguments to the run). Attacks
that never end (spin, sleep, fork-bomb, hog) print `NAME started` first and are meant
to be ended by a limit.
"""
import ctypes
import errno
import fcntl
import mmap
import os
import shutil
import socket
import subprocess
import sys
import termios
import time

libc = ctypes.CDLL(None, use_errno=True)
LDSO = {"x86_64": "/lib64/ld-linux-x86-64.so.2",
        "aarch64": "/lib/ld-linux-aarch64.so.1"}[os.uname().machine]


def _c(result):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def written_binary():
    path = os.path.join(os.environ["HOME"], "true")
    if not os.path.exists(path):
        shutil.copyfile("/bin/true", path)
        os.chmod(path, 0o755)
    return path


def connect(family, addr):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(addr)


def fork_and_wait():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def run_system_binary():
    subprocess.run(["/bin/true"], check=True)


def run_written_binary():
    subprocess.run([written_binary()], check=True)


def exec_written_binary():
    os.execv(written_binary(), ["true"])


def ldso_written_binary():
    proc = subprocess.run([LDSO, written_binary()], capture_output=True, text=True)
    if proc.returncode == 127 and "failed to map segment" in proc.stderr:
        raise OSError(errno.EPERM, proc.stderr.strip())   # mmap(PROT_EXEC) refused
    if proc.returncode:
        raise RuntimeError(f"ld.so exited {proc.returncode}: {proc.stderr.strip()}")


def mmap_exec_written():
    with open(written_binary(), "rb") as f:
        mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC)


def memfd():
    os.close(os.memfd_create("payload"))


def tiocsti():
    fcntl.ioctl(0, termios.TIOCSTI, b"x")


def ptrace():
    _c(libc.ptrace(0, 0, None, None))   # PTRACE_TRACEME


def userns():
    _c(libc.unshare(0x10000000))   # CLONE_NEWUSER


def alloc(size):
    data = bytearray(size)
    data[::4096] = b"x" * len(range(0, size, 4096))


def spin():
    print("spin started", flush=True)
    while True:
        pass


def sleep():
    print("sleep started", flush=True)
    time.sleep(1e6)


def fork_bomb():
    print("fork-bomb started", flush=True)
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)


def hog(step=64 << 20):
    """Grow forever in `step` chunks, in this process and a forked one."""
    print("hog started", flush=True)
    os.fork()
    chunks = []
    while True:
        try:
            chunks.append(bytearray(step))
            chunks[-1][::4096] = b"x" * len(range(0, step, 4096))
        except MemoryError:
            time.sleep(0.01)


ATTACKS = {
    "uid": lambda: print("uid", os.getuid(), flush=True),
    "inet-loopback": lambda: connect(socket.AF_INET, ("127.0.0.1", 9)),
    "inet6-loopback": lambda: connect(socket.AF_INET6, ("::1", 9)),
    "netlink": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close(),
    "write-etc": lambda: open("/etc/lip-hostile", "w").close(),
    "write-host-tmp": lambda: open("/tmp/lip-hostile", "w").close(),
    "write-scratch": lambda: open(os.path.join(os.environ["HOME"], "f"), "w").close(),
    "read-shadow": lambda: open("/etc/shadow").close(),
    "fork": fork_and_wait,
    "run-system-binary": run_system_binary,
    "run-written-binary": run_written_binary,
    "exec-written-binary": exec_written_binary,
    "ldso-written-binary": ldso_written_binary,
    "mmap-exec-written": mmap_exec_written,
    "memfd": memfd,
    "tiocsti": tiocsti,
    "ptrace": ptrace,
    "userns": userns,
    "kill-init": lambda: os.kill(1, 0),
    "alloc-8g": lambda: alloc(8 << 30),
    "spin": spin,
    "sleep": sleep,
    "fork-bomb": fork_bomb,
    "hog": hog,
}
VALUED = {
    "write": lambda path: open(path, "w").close(),
    "read": lambda path: open(path).close(),
    "connect-unix": lambda path: connect(socket.AF_UNIX, path),
    "kill": lambda pid: os.kill(int(pid), 0),
}

for arg in sys.argv[1:]:
    if arg.startswith("/"):
        continue
    name, _, value = arg.partition("=")
    try:
        VALUED[name](value) if value else ATTACKS[name]()
        print(name, "ok", flush=True)
    except MemoryError:
        print(name, "MemoryError", flush=True)
    except subprocess.CalledProcessError as exc:
        print(name, f"exit {exc.returncode}", flush=True)
    except OSError as exc:
        print(name, errno.errorcode.get(exc.errno, exc.errno), flush=True)
    except RuntimeError as exc:
        print(name, "unexpected", exc, flush=True)
