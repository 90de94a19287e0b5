"""`lip run --sandbox`: hostile programs — as a Python LIP, as `python prog.py` and as a
shell script — reach predd and nothing else, never run as root, cannot run what they
write, and are ended by their limits; the launcher refuses (and runs nothing) when it
cannot confine; predd keeps serving the test process throughout."""
from __future__ import annotations

import errno
import os
import pty
import signal
import subprocess
import sys

import pytest

from liblip.sandbox import cgroups, landlock
from tests.conftest import ROOT

LIPS = os.path.join(os.path.dirname(__file__), "..", "lips")
PROBE = os.path.join(LIPS, "probe_sandbox.py")
HOSTILE_PY = os.path.join(LIPS, "hostile.py")
HOSTILE_SH = os.path.join(LIPS, "hostile.sh")
LIP_RUN = [sys.executable, "-m", "liblip.cli", "run"]
FORMS = {   # how each form runs hostile.py with the given attack arguments
    "lip": lambda *a: [HOSTILE_PY, *a],
    "python": lambda *a: ["--", sys.executable, HOSTILE_PY, *a],
}

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root"),
    pytest.mark.skipif(landlock.abi_version() < 1, reason="no Landlock on this kernel"),
]


def sandbox(*args: str, stdin=subprocess.DEVNULL, cwd: str = ROOT, timeout: float = 120,
            env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LIP_RUN, "--sandbox", *args], capture_output=True, text=True,
                          stdin=stdin, cwd=cwd, timeout=timeout, env=env)


def start(*args: str, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([*LIP_RUN, "--sandbox", *args], stdin=stdin, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def uid_of(line: str) -> int:
    word, uid = line.split()
    assert word == "uid"
    return int(uid)


def assert_predd_serves(lip) -> None:
    kv = lip.kv_create()
    tokens = lip.tokenize("Hello, world")
    dist = lip.pred(kv, tokens)
    assert lip.kv_stat(kv)["tokens"] == len(tokens)
    assert 0 <= dist.argmax() < lip.info()["vocab_size"]
    lip.kv_remove(kv)


def processes_of(uid: int) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                out.append(int(pid))
        except FileNotFoundError:
            pass
    return out


def memory_cgroup() -> bool:
    group = cgroups.RunCgroup.create(f"probe-{os.getpid()}", 1 << 30, 8)
    try:
        return group.memory is not None
    finally:
        group.remove()


@pytest.fixture
def secret_of_another_uid(tmp_path):
    """A 0600 file of uid 65534 in a directory anyone may enter."""
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "secret"
    path.write_text("not yours")
    os.chown(path, 65534, 65534)
    os.chmod(path, 0o600)
    return str(path)


# ---------------------------------------------------------------- reaching predd

def test_sandboxed_lip_reaches_predd_and_nothing_else(lip, predd):
    proc = subprocess.run([*LIP_RUN, "--sandbox", PROBE], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PREDD_ADDR": predd.addr, "PROBE_REPO": ROOT})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("pred ok")
    assert lines[1:] == [
        f"write /etc denied {errno.EACCES}",
        f"write cwd repo denied {errno.EACCES}",
        "write scratch allowed",
        f"inet socket denied {errno.EACCES}",
        f"fork denied {errno.EPERM}",
        f"exec denied {errno.EPERM}",
        "thread ok",
        "logits buffer False",
    ]
    assert not os.path.exists(os.path.join(ROOT, "probe"))
    assert_predd_serves(lip)


# ---------------------------------------------------------------- the hostile matrix

# attack -> (as a Python LIP, as `python hostile.py`)
PY_EXPECTED = {
    "inet-loopback": ("EACCES", "EACCES"),
    "inet6-loopback": ("EACCES", "EACCES"),
    "netlink": ("EACCES", "EACCES"),
    "write-etc": ("EACCES", "EACCES"),
    "write-host-tmp": ("EACCES", "EACCES"),
    "write-scratch": ("ok", "ok"),
    "read-shadow": ("EACCES", "EACCES"),
    "fork": ("EPERM", "ok"),
    "run-system-binary": ("EPERM", "ok"),
    "run-written-binary": ("EPERM", "EACCES"),     # seccomp / Landlock: no execute
    "exec-written-binary": ("EPERM", "EACCES"),
    "ldso-written-binary": ("EPERM", "EPERM"),     # no fork / scratch is noexec
    "mmap-exec-written": ("EPERM", "EPERM"),
    "memfd": ("EPERM", "EPERM"),
    "ptrace": ("EPERM", "EPERM"),
    "userns": ("EPERM", "EPERM"),
    "tiocsti": ("EPERM", "EPERM"),
    "kill-init": ("EPERM", "EPERM"),               # the run's init is root
    "alloc-8g": ("MemoryError", "MemoryError"),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_hostile_python(form, lip, predd, secret_of_another_uid, tmp_path_factory):
    hidden = tmp_path_factory.mktemp("hidden")   # 0700, and no argument names it
    (hidden / "file").write_text("x")
    for stray in ("/etc/lip-hostile", "/tmp/lip-hostile"):
        if os.path.exists(stray):
            os.unlink(stray)
    socket_path = predd.addr.removeprefix("ipc://")
    valued = {
        f"write={ROOT}/hostile-probe": "EACCES",
        f"read={secret_of_another_uid}": "EACCES",   # exposed below, but not readable
        f"read={hidden}/file": "ENOENT",             # never exposed: not there at all
        f"connect-unix={socket_path}": "ok",         # the one socket a LIP may reach
        f"kill={predd.proc.pid}": "ESRCH",           # not in the run's pid namespace
    }
    column = 0 if form == "lip" else 1
    attacks = ["uid", *PY_EXPECTED, *valued, secret_of_another_uid]
    master, slave = pty.openpty()   # stdin is a terminal, for TIOCSTI
    try:
        proc = sandbox(*FORMS[form](*attacks), stdin=slave)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert uid_of(lines[0]) >= 200000
    expected = (["uid ok"] + [f"{name} {want[column]}" for name, want in PY_EXPECTED.items()]
                + [f"{arg.partition('=')[0]} {want}" for arg, want in valued.items()])
    assert lines[1:] == expected
    for stray in ("/etc/lip-hostile", "/tmp/lip-hostile", f"{ROOT}/hostile-probe"):
        assert not os.path.exists(stray)
    assert_predd_serves(lip)


SH_EXPECTED = {
    "inet-loopback": 1, "write-etc": 1, "write-host-tmp": 1, "write-scratch": 0,
    "read-shadow": 1, "run-system-binary": 0,
    "run-written-binary": 126,    # bash: Permission denied (Landlock, noexec)
    "ldso-written-binary": 127,   # ld.so: failed to map segment (noexec)
}


def test_hostile_shell(lip, predd, secret_of_another_uid):
    valued = {f"write={ROOT}/hostile-probe": 1, f"read={secret_of_another_uid}": 1,
              f"kill={predd.proc.pid}": 1, "kill=1": 1}
    proc = sandbox("--", HOSTILE_SH, "uid", *SH_EXPECTED, *valued, secret_of_another_uid)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert uid_of(lines[0]) >= 200000
    assert lines[1:] == (["uid rc=0"] + [f"{name} rc={rc}" for name, rc in SH_EXPECTED.items()]
                         + [f"{arg.partition('=')[0]} rc={rc}" for arg, rc in valued.items()])
    assert not os.path.exists(f"{ROOT}/hostile-probe")
    assert_predd_serves(lip)


# ---------------------------------------------------------------- identity

def test_id_from_tmp_is_not_root():
    """What this project's before-stop hook runs."""
    proc = subprocess.run([*LIP_RUN, "--sandbox", "--", "/usr/bin/id", "-u"], cwd="/tmp",
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 200000


def test_concurrent_runs_get_different_uids():
    first = start("--", "/bin/sh", "-c", "id -u; id -G; read line", stdin=subprocess.PIPE)
    try:
        uid_a, groups_a = int(first.stdout.readline()), first.stdout.readline().split()
        second = sandbox("--", "/bin/sh", "-c", "id -u; id -G")
        uid_b, groups_b = second.stdout.split("\n")[:2]
        first.stdin.write("\n")
        first.stdin.close()
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 0, second.stderr
    assert 200000 <= uid_a != int(uid_b) >= 200000
    assert groups_a == [str(uid_a)] and groups_b.split() == [uid_b]   # no other groups


def test_fixed_uid():
    proc = sandbox("--uid", "4242", "--", "/bin/sh", "-c", "id -u; id -g; id -G")
    assert (proc.returncode, proc.stdout) == (0, "4242\n4242\n4242\n"), proc.stderr


def test_refuses_uid_0_and_runs_nothing():
    proc = sandbox("--uid", "0", "--", "/bin/echo", "ran")
    assert (proc.returncode, proc.stdout) == (126, "")
    assert proc.stderr == ("lip: EPERM: sandbox: --uid 0: a sandboxed program never runs "
                           "as root\n")


# ---------------------------------------------------------------- failing closed

def test_program_in_a_closed_directory_is_exposed(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    program = closed / "prog.sh"
    program.write_text("#!/bin/sh\necho ran as $(id -u)\nls /tmp\n")
    os.chmod(program, 0o755)
    proc = sandbox("--", str(program))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ran as 2")
    # /tmp is covered: only the run's scratch and what it needs are bound back (this
    # program, and the checkout and venv when they live under /tmp, as a CI clone may)
    needed = {"pytest-of-root", "scratch"} | {
        os.path.realpath(p).split(os.sep)[2] for p in (ROOT, sys.prefix)
        if os.path.realpath(p).startswith("/tmp/")}
    assert proc.stdout.split("\n")[1:] == sorted(needed) + [""]


@pytest.mark.parametrize("mode", [0o700, 0o744])
def test_unreachable_program_is_refused_and_never_runs(tmp_path, mode):
    program = tmp_path / "prog.sh"
    program.write_text("#!/bin/sh\necho ran\n")
    os.chmod(program, mode)
    proc = sandbox("--", str(program))
    assert (proc.returncode, proc.stdout) == (126, "")
    assert proc.stderr.startswith(f"lip: EPERM: sandbox: uid 2")
    assert proc.stderr.endswith(f" cannot execute {program}: refusing to run (cannot confine "
                                "without it)\n")


def test_unreadable_python_lip_is_refused(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("print('ran')\n")
    os.chmod(program, 0o600)
    proc = sandbox(str(program))
    assert (proc.returncode, proc.stdout) == (126, "")
    assert proc.stderr.endswith(f" cannot read {program}: refusing to run (cannot confine "
                                "without it)\n")


def test_missing_program():
    proc = sandbox("--", "no-such-program-anywhere")
    assert (proc.returncode, proc.stdout) == (127, "")
    assert proc.stderr == "lip: ENOENT: sandbox: no-such-program-anywhere: no such program\n"


def test_sandbox_refuses_tcp_predd():
    proc = subprocess.run([*LIP_RUN, "--sandbox", PROBE], capture_output=True, text=True,
                          timeout=60, cwd=ROOT,
                          env={**os.environ, "PREDD_ADDR": "tcp://127.0.0.1:5555"})
    assert proc.returncode == 126
    assert proc.stderr == ("lip: EINVAL: sandbox: a sandboxed LIP has no network: use an "
                           "ipc:// predd address, not tcp://127.0.0.1:5555\n")


@pytest.mark.parametrize("flags,message", [
    (["--memory", "lots"], "lip: EINVAL: --memory: 'lots' is not a size (bytes, or a number "
                           "with K, M, G or T)\n"),
    (["--memory", "1M"], "lip: EINVAL: sandbox: memory 1048576 is below 32M\n"),
    (["--wall-seconds", "0"], "lip: EINVAL: sandbox: wall-seconds must be >= 1\n"),
])
def test_bad_limits(flags, message):
    proc = sandbox(*flags, "--", "/bin/echo", "ran")
    assert proc.stdout == "" and proc.stderr == message
    assert proc.returncode == (1 if "--memory: " in message else 126)


def test_limits_need_sandbox():
    proc = subprocess.run([*LIP_RUN, "--memory", "1G", "/bin/echo", "ran"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == "lip: EINVAL: --memory: only with --sandbox\n"


# ---------------------------------------------------------------- limits

@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(FORMS))
def test_wall_time_limit(form, lip):
    proc = sandbox("--wall-seconds", "2", *FORMS[form]("sleep"))
    assert (proc.returncode, proc.stdout) == (124, "sleep started\n")
    assert proc.stderr == "lip: ETIME: sandbox: wall time limit (2 s) reached\n"
    assert_predd_serves(lip)


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(FORMS))
def test_cpu_time_limit(form):
    proc = sandbox("--cpu-seconds", "1", *FORMS[form]("spin"))
    assert (proc.returncode, proc.stdout) == (124, "spin started\n")
    assert proc.stderr == "lip: ETIME: sandbox: cpu time limit (1 s) reached\n"


@pytest.mark.slow
@pytest.mark.skipif(not memory_cgroup(), reason="no writable memory cgroup here")
def test_memory_limit_for_the_whole_run(lip):
    """Two processes of 64 MiB steps: each stays under RLIMIT_AS, together they pass the
    run's cgroup limit, and the OOM kill ends the run."""
    proc = sandbox("--memory", "256M", "--wall-seconds", "120", "--", sys.executable,
                   HOSTILE_PY, "hog")
    assert (proc.returncode, proc.stdout) == (137, "hog started\n")
    assert proc.stderr == "lip: ENOMEM: sandbox: memory limit (256M) reached\n"
    assert_predd_serves(lip)


@pytest.mark.slow
@pytest.mark.parametrize("program", [
    ["--", sys.executable, HOSTILE_PY, "uid", "fork-bomb"],
    ["--", HOSTILE_SH, "uid", "fork-bomb"],
])
def test_fork_bomb_is_bounded(program, lip):
    bomb = start("--max-procs", "16", "--wall-seconds", "4", *program)
    try:
        uid = uid_of(bomb.stdout.readline())
        assert bomb.stdout.readline() in ("uid ok\n", "uid rc=0\n")
        assert bomb.stdout.readline() == "fork-bomb started\n"
        other = sandbox("--", "/usr/bin/id", "-u")   # while the bomb runs
        assert other.returncode == 0, other.stderr
        assert int(other.stdout) not in (0, uid)
        assert_predd_serves(lip)
        assert bomb.wait(timeout=60) == 124
    finally:
        bomb.kill()
        bomb.wait()
    assert bomb.stderr.read() == "lip: ETIME: sandbox: wall time limit (4 s) reached\n"
    assert processes_of(uid) == []


def test_stop_signal_ends_the_whole_run():
    """The gateway cancels a run with SIGTERM to the launcher: everything in it dies."""
    run = start("--", HOSTILE_SH, "uid", "fork-bomb")
    try:
        uid = uid_of(run.stdout.readline())
        assert run.stdout.readline() == "uid rc=0\n"
        assert run.stdout.readline() == "fork-bomb started\n"
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        run.kill()
        run.wait()
    assert processes_of(uid) == []


# ---------------------------------------------------------------- the KVFS mount

def test_kvfs_mount_is_writable_but_not_executable(kvfs, lip):
    os.mkdir(kvfs.path("u"))
    os.chown(kvfs.path("u"), 4242, 4242)
    script = ("cd \"$KVFS_MOUNT/u\" && touch a.kv && cp a.kv b.kv && echo made rc=$?; "
              "cp /bin/true t 2>/dev/null; chmod +x t 2>/dev/null; ./t 2>/dev/null; "
              "echo exec rc=$?")
    proc = sandbox("--uid", "4242", "--", "/bin/sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["made rc=0", "exec rc=126"]
    assert sorted(n for n in os.listdir(kvfs.path("u")) if n.endswith(".kv")) == \
        ["a.kv", "b.kv"]
    assert os.stat(kvfs.path("u", "b.kv")).st_uid == 4242
