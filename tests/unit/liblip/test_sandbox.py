"""The sandbox's pure parts: sizes and limits, the mount plan, the seccomp programs
(run through a small classic-BPF interpreter), Landlock rights per ABI, uid
allocation, cgroup discovery, and where clients look for predd."""
from __future__ import annotations

import errno
import os
import struct

import pytest

import symphony_protocol as protocol
from symphony_protocol import addresses
from liblip.sandbox import cgroups, identity, landlock, mounts, seccomp
from liblip.sandbox.launcher import Request, SandboxError, run
from liblip.sandbox.run_limits import Limits, format_size, parse_size

# ---------------------------------------------------------------- sizes and limits


@pytest.mark.parametrize("text,value", [
    ("512M", 512 << 20), ("2G", 2 << 30), ("2g", 2 << 30), ("2GiB", 2 << 30),
    ("64k", 64 << 10), ("1048576", 1 << 20), ("1T", 1 << 40), (" 3M ", 3 << 20)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "2X", "1.5G", "G", "2 G B", "0x10"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (2 << 30, 512 << 20, 3 << 10, 1000)] == \
        ["2G", "512M", "3K", "1000"]


def test_limits_defaults_and_problems():
    assert Limits() == Limits(2 << 30, 600, 3600, 64)
    assert Limits().problems() == []
    assert Limits(memory=1 << 20, cpu_seconds=0, max_procs=0).problems() == [
        "memory 1048576 is below 32M", "cpu-seconds must be >= 1", "max-procs must be >= 1"]
    import resource
    rl = dict((r, (s, h)) for r, s, h in Limits(memory=1 << 30, cpu_seconds=5).rlimits())
    assert rl[resource.RLIMIT_AS] == (1 << 30, 1 << 30)
    assert rl[resource.RLIMIT_CPU] == (5, 6)
    assert rl[resource.RLIMIT_NPROC] == (64, 64)
    assert rl[resource.RLIMIT_CORE] == (0, 0)


# ---------------------------------------------------------------- the mount plan

FAKE_LINKS = {
    "/work/venv/bin/python": "python3",
    "/work/venv/bin/python3": "/root/.pyenv/versions/3.11/bin/python3.11",
    "/var/run": "../run",
}
FAKE_BLOCKED = {"/root", "/root/.pyenv/versions/3.11/lib/secret", "/tmp/pytest-of-root",
                "/tmp/pytest-of-root/pytest-1"}


def _plan(needed, hidden=("/tmp", "/run")):
    return mounts.plan(needed, list(hidden), FAKE_BLOCKED.__contains__, FAKE_LINKS.get)


def test_resolution_follows_links():
    assert mounts.resolution("/work/venv/bin/python", FAKE_LINKS.get) == [
        ("/", "work"), ("/work", "venv"), ("/work/venv", "bin"), ("/work/venv/bin", "python"),
        ("/work/venv/bin", "python3"), ("/", "root"), ("/root", ".pyenv"),
        ("/root/.pyenv", "versions"), ("/root/.pyenv/versions", "3.11"),
        ("/root/.pyenv/versions/3.11", "bin"), ("/root/.pyenv/versions/3.11/bin", "python3.11")]
    assert mounts.resolution("/var/run/symphony/./predd.sock", FAKE_LINKS.get) == [
        ("/", "var"), ("/var", "run"), ("/", "run"), ("/run", "symphony"),
        ("/run/symphony", "predd.sock")]


def test_resolution_loop():
    with pytest.raises(OSError) as exc:
        mounts.resolution("/a", {"/a": "/b", "/b": "/a"}.get)
    assert exc.value.errno == errno.ELOOP


def test_plan_covers_blocked_and_hidden_dirs_shallow_first():
    covers = _plan(["/work/venv/bin/python", "/tmp/pytest-of-root/pytest-1/predd0/predd.sock",
                    "/var/run/symphony/predd.sock", "/usr/bin/id"])
    assert covers == [
        mounts.Cover("/root", (".pyenv",)),
        mounts.Cover("/run", ("symphony",)),
        mounts.Cover("/tmp", ("pytest-of-root",)),
        mounts.Cover("/tmp/pytest-of-root", ("pytest-1",)),
        mounts.Cover("/tmp/pytest-of-root/pytest-1", ("predd0",)),
    ]


def test_plan_hidden_dir_without_needs_is_empty():
    assert _plan(["/usr/bin/id"]) == [mounts.Cover("/run", ()), mounts.Cover("/tmp", ())]


def test_plan_nested_blocked_dir_below_a_cover():
    covers = _plan(["/root/.pyenv/versions/3.11/lib/secret/x.py", "/root/.pyenv/versions/3.11"],
                   hidden=())
    assert covers == [mounts.Cover("/root", (".pyenv",)),
                      mounts.Cover("/root/.pyenv/versions/3.11/lib/secret", ("x.py",))]


def test_plan_refuses_a_blocked_root():
    with pytest.raises(OSError) as exc:
        mounts.plan(["/usr/bin/id"], [], lambda d: d == "/", FAKE_LINKS.get)
    assert exc.value.errno == errno.EACCES


def test_scratch_path_avoids_needed_names():
    assert mounts.scratch_path([mounts.Cover("/tmp", ("a",))], 7) == "/tmp/scratch"
    assert mounts.scratch_path([mounts.Cover("/tmp", ("scratch",))], 7) == "/tmp/scratch-7"
    with pytest.raises(OSError):
        mounts.scratch_path([mounts.Cover("/tmp", ("scratch", "scratch-7"))], 7)


def test_can_search():
    st = os.stat_result((0o40750, 0, 0, 0, 10, 20, 0, 0, 0, 0))
    assert mounts.can_search(st, 10, 99)         # owner: rwx
    assert mounts.can_search(st, 11, 20)         # group: r-x
    assert not mounts.can_search(st, 11, 21)     # others: ---


# ---------------------------------------------------------------- seccomp

def bpf_run(prog, nr, arch, args=(0,) * 6):
    """A classic-BPF interpreter for the opcodes the filters use."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == seccomp.LD_W_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == seccomp.RET_K:
            return k
        else:
            hit = {seccomp.JEQ_K: acc == k, seccomp.JGE_K: acc >= k,
                   seccomp.JSET_K: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)


X86 = seccomp.ARCHES["x86_64"]
NR = X86.numbers
EPERM, EACCES, ENOSYS = (seccomp.ret_errno(e) for e in (errno.EPERM, errno.EACCES,
                                                        errno.ENOSYS))
ALLOW = seccomp.RET_ALLOW


@pytest.mark.parametrize("arch", sorted(seccomp.ARCHES))
@pytest.mark.parametrize("build", [seccomp.base_program, seccomp.strict_program])
def test_seccomp_program_shape(arch, build):
    prog = build(arch)
    assert prog[:3] == [(seccomp.LD_W_ABS, 0, 0, seccomp.OFF_ARCH),
                        (seccomp.JEQ_K, 1, 0, seccomp.ARCHES[arch].audit),
                        (seccomp.RET_K, 0, 0, seccomp.RET_KILL_PROCESS)]
    assert prog[-1] == (seccomp.RET_K, 0, 0, ALLOW)
    assert len(prog) < 4096
    for pc, (code, jt, jf, _) in enumerate(prog):   # every jump lands inside
        if code in (seccomp.JEQ_K, seccomp.JGE_K, seccomp.JSET_K):
            assert pc + 1 + max(jt, jf) < len(prog)


@pytest.mark.parametrize("call,args,expected", [
    ("socket", (1,), ALLOW), ("socket", (2,), EACCES), ("socket", (10,), EACCES),
    ("socket", (16,), EACCES), ("ioctl", (0, 0x5412), EPERM), ("ioctl", (0, 0x541C), EPERM),
    ("ioctl", (0, 0x5401), ALLOW), ("memfd_create", (), EPERM), ("ptrace", (), EPERM),
    ("unshare", (), EPERM), ("setns", (), EPERM), ("mount", (), EPERM), ("bpf", (), EPERM),
    ("io_uring_setup", (), EPERM), ("keyctl", (), EPERM), ("perf_event_open", (), EPERM),
    ("clone", (0x10000000,), EPERM), ("clone", (0x01200011,), ALLOW),
    ("clone", (0x003D0F00,), ALLOW), ("clone3", (), ENOSYS), ("execve", (), ALLOW),
    ("fork", (), ALLOW)])
def test_base_filter_decisions(call, args, expected):
    args = tuple(args) + (0,) * (6 - len(args))
    assert bpf_run(seccomp.base_program("x86_64"), NR[call], X86.audit, args) == expected


@pytest.mark.parametrize("call,args,expected", [
    ("execve", (), EPERM), ("execveat", (), EPERM), ("fork", (), EPERM), ("vfork", (), EPERM),
    ("clone", (0x01200011,), EPERM), ("clone", (0x003D0F00,), ALLOW), ("clone3", (), ENOSYS),
    ("socket", (2,), ALLOW)])   # sockets are the base filter's business
def test_strict_filter_decisions(call, args, expected):
    args = tuple(args) + (0,) * (6 - len(args))
    assert bpf_run(seccomp.strict_program("x86_64"), NR[call], X86.audit, args) == expected


def test_filters_refuse_x32_and_foreign_arches():
    for build in (seccomp.base_program, seccomp.strict_program):
        prog = build("x86_64")
        assert bpf_run(prog, 0x40000000 | NR["memfd_create"], X86.audit) == ENOSYS
        assert bpf_run(prog, 0, 0x40000003) == seccomp.RET_KILL_PROCESS   # i386
        assert bpf_run(prog, 0, X86.audit) == ALLOW                       # read


def test_aarch64_numbers():
    arm = seccomp.ARCHES["aarch64"]
    prog = seccomp.base_program("aarch64")
    assert bpf_run(prog, arm.numbers["memfd_create"], arm.audit) == EPERM
    assert bpf_run(prog, arm.numbers["socket"], arm.audit, (2, 0, 0, 0, 0, 0)) == EACCES
    assert bpf_run(seccomp.strict_program("aarch64"), arm.numbers["execve"],
                   arm.audit) == EPERM


# ---------------------------------------------------------------- Landlock

def test_landlock_rights_per_abi():
    assert landlock.handled_fs(1) == (1 << 13) - 1
    assert landlock.handled_fs(3) == (1 << 15) - 1
    assert landlock.handled_fs(7) == (1 << 16) - 1
    policy = landlock.Policy(readable=["/usr"], executable=["/usr/bin"],
                             writable=["/tmp", "/nonexistent-dir"])
    rules = dict(policy.rules(1))
    assert rules["/usr"] == landlock.READ
    assert rules["/usr/bin"] == landlock.READ | landlock.EXECUTE
    assert rules["/tmp"] & landlock.EXECUTE == 0
    assert rules["/tmp"] & landlock.REFER == 0          # not in ABI 1
    assert dict(policy.rules(3))["/tmp"] & landlock.TRUNCATE
    assert "/nonexistent-dir" not in rules
    assert rules["/dev/null"] == landlock.READ_FILE | landlock.WRITE_FILE
    assert rules["/dev/urandom"] == landlock.READ_FILE
    assert "/dev" not in landlock.readable_roots()


# ---------------------------------------------------------------- identity

def test_fixed_uid():
    assert identity.fixed(4242) == identity.Identity(4242, 4242)
    with pytest.raises(OSError) as exc:
        identity.fixed(0)
    assert exc.value.errno == errno.EPERM
    with pytest.raises(OSError) as exc:
        identity.fixed(-5)
    assert exc.value.errno == errno.EINVAL


@pytest.mark.skipif(os.geteuid() != 0, reason="uid allocation keeps a root-only directory")
def test_fresh_uids_follow_a_counter(tmp_path):
    state = str(tmp_path / "sandbox")
    first = identity.fresh(state)
    second = identity.fresh(state)
    try:
        assert identity.UID_BASE <= first.uid < second.uid < identity.UID_BASE + 100
        assert first.gid == first.uid and second.gid == second.uid
    finally:
        first.release()
        second.release()
    assert oct(os.stat(state).st_mode & 0o777) == "0o700"
    os.chmod(state, 0o777)
    with pytest.raises(OSError) as exc:
        identity.fresh(state)
    assert exc.value.errno == errno.EPERM


def test_run_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError) as exc:
        run(Request(["/usr/bin/id"], {}))
    assert (exc.value.code, exc.value.status) == ("EPERM", 126)
    assert exc.value.message.startswith("sandbox: lip run --sandbox needs root")


# ---------------------------------------------------------------- cgroups

HYBRID_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
32 30 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
33 30 0:29 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
34 30 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "8:pids:/\n4:memory:/process_api/abc\n2:cpuacct:/\n0::/\n"
V2_MOUNTINFO = "40 1 0:35 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
V2_CGROUP = "0::/user.slice/session-1.scope\n"


def test_cgroup_discovery(tmp_path):
    (tmp_path / "mi").write_text(HYBRID_MOUNTINFO)
    (tmp_path / "cg").write_text(HYBRID_CGROUP)
    found = cgroups.discover(str(tmp_path / "mi"), str(tmp_path / "cg"))
    assert found.v2 == "/sys/fs/cgroup/unified"
    assert found.v1 == {"cpuacct": "/sys/fs/cgroup/cpuacct",
                        "memory": "/sys/fs/cgroup/memory/process_api/abc",
                        "pids": "/sys/fs/cgroup/pids"}
    (tmp_path / "mi").write_text(V2_MOUNTINFO)
    (tmp_path / "cg").write_text(V2_CGROUP)
    found = cgroups.discover(str(tmp_path / "mi"), str(tmp_path / "cg"))
    assert (found.v2, found.v2_own, found.v1) == ("/sys/fs/cgroup",
                                                  "/user.slice/session-1.scope", {})


def test_cgroup_on_a_host_without_cgroups_sets_nothing(tmp_path):
    group = cgroups.RunCgroup.create("run-1", 1 << 30, 65, cgroups.Mounts(
        v1={"memory": str(tmp_path / "missing")}))
    assert (group.memory, group.pids, group.cpu, group.parts) == (None, None, None, [])
    assert group.cpu_seconds() is None and group.oom_kills() == 0


# ---------------------------------------------------------------- where predd is

def test_default_addr_order(monkeypatch, tmp_path):
    monkeypatch.delenv("PREDD_ADDR", raising=False)
    monkeypatch.delenv("SYMPHONY_RUNDIR", raising=False)
    monkeypatch.setattr(addresses, "SYSTEM_RUNDIR", str(tmp_path / "system"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert protocol.default_addr() == "ipc:///tmp/symphony-1000/predd.sock"
    (tmp_path / "system").mkdir()
    (tmp_path / "system" / "predd.sock").write_text("")
    assert protocol.default_addr() == f"ipc://{tmp_path}/system/predd.sock"
    monkeypatch.setenv("SYMPHONY_RUNDIR", "/srv/run")
    assert protocol.default_addr() == "ipc:///srv/run/predd.sock"
    monkeypatch.setenv("PREDD_ADDR", "tcp://127.0.0.1:1")
    assert protocol.default_addr() == "tcp://127.0.0.1:1"
    assert protocol.default_addr("/x") == "ipc:///x/predd.sock"
