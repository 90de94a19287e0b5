"""Mount helpers for the kvfs tests (the `kvfs` fixture itself is in conftest.py): start
kvfsd on a fresh mount point, and make sure no test — passing, failing or interrupted —
ever leaves a mount behind.

Mount points live directly under /tmp (mode 0755), not under pytest's 0700 tmp_path, so
that a second uid can reach them and a "Permission denied" comes from the file's mode.
"""
from __future__ import annotations

import ast
import json
import os
import select
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from predd.server.launch import die_with_parent, terminate, wait_ready
from tests.conftest import ROOT


def is_mounted(mount: str) -> bool:
    mount = os.path.abspath(mount)
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == mount:
                return True
    return False


def force_unmount(mount: str) -> None:
    if is_mounted(mount):
        subprocess.run(["fusermount3", "-u", "-z", mount], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def make_mountpoint() -> str:
    mount = tempfile.mkdtemp(prefix="kvfs-mnt-", dir="/tmp")
    os.chmod(mount, 0o755)
    return mount


@dataclass
class Kvfs:
    """A running kvfsd: its mount point, state directory, predd address and log."""
    mount: str
    state: str
    addr: str
    log: str
    args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)

    def path(self, *names: str) -> str:
        return os.path.join(self.mount, *names)

    def start(self, timeout: float = 30.0, clear_stale: bool = True) -> Kvfs:
        if clear_stale:
            force_unmount(self.mount)
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfsd", self.mount, "--predd", self.addr,
                 "--state", self.state, *self.args],
                stdout=subprocess.PIPE, stderr=err, cwd=ROOT,
                env={**os.environ, **self.env}, preexec_fn=die_with_parent)
        mounted = wait_ready(self.proc, timeout)
        if mounted is None:
            self.stop()
            raise RuntimeError(f"kvfsd did not become ready in {timeout:g} s: "
                               f"{self.log_text()[-2000:]}")
        assert mounted == self.mount
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, SIGKILL if need be; the mount is gone afterwards in every case."""
        code = None
        if self.proc is not None:
            code = terminate(self.proc, timeout)
            self.proc.stdout.close()
        force_unmount(self.mount)
        return code

    def restart(self) -> Kvfs:
        code = self.stop()
        assert code == 0, f"kvfsd exited {code}: {self.log_text()[-2000:]}"
        assert not is_mounted(self.mount)
        return self.start()

    def log_text(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def clear(self) -> None:
        """Remove every file so the caches go back to predd's pool."""
        if self.proc is None or self.proc.poll() is not None or not is_mounted(self.mount):
            return
        for name in os.listdir(self.mount):
            path = os.path.join(self.mount, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                pass


def start_kvfsd(addr: str, state: str, *args: str, mount: str | None = None,
                env: dict | None = None) -> Kvfs:
    mount = mount or make_mountpoint()
    os.makedirs(os.path.dirname(state) or ".", exist_ok=True)
    kvfs = Kvfs(mount, state, addr, f"{state}.log", args, env=env or {})
    return kvfs.start()


def finish(kvfs: Kvfs, clear: bool = True) -> int | None:
    """Teardown: free the caches (unless told not to), unmount, remove the mount point."""
    try:
        if clear:
            kvfs.clear()
    finally:
        code = kvfs.stop()
        try:
            os.rmdir(kvfs.mount)
        except OSError:
            pass
    return code


# ---------------------------------------------------------------- small helpers

def sh(cmd: str, cwd: str | None = None, user: str | None = None,
       timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a shell command line (as `user` via runuser when given)."""
    argv = ["bash", "-c", cmd]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def saved_state(state: str) -> dict:
    """What kvfsd has committed to its state directory: {"nodes": {ino: row},
    "entries": {(dir, name): ino}, "meta": {...}}, read beside the running kvfsd."""
    db = sqlite3.connect(f"file:{os.path.join(state, 'namespace.db')}?mode=ro", uri=True)
    try:
        return {"nodes": {ino: json.loads(doc)
                          for ino, doc in db.execute("SELECT ino, doc FROM node")},
                "entries": {(d, bytes(name)): ino for d, name, ino in
                            db.execute("SELECT dir, name, ino FROM entry")},
                "meta": {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}}
    finally:
        db.close()


def xattr_int(path: str, name: str) -> int:
    return int(os.getxattr(path, f"user.kv.{name}"))


def eventually(predicate, timeout: float = 5.0, interval: float = 0.02):
    """Poll until `predicate()` is truthy (FUSE releases arrive after close returns)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def fill(lip, path: str, tokens: list[int]) -> None:
    """Append tokens to the cache file `path` in place (a read-write open)."""
    kv = lip.kv_open(path, write=True)
    try:
        lip.prefill(kv, tokens)
    finally:
        lip.kv_close(kv)


def pred_logits(lip, path: str, token: int):
    """The logits after `token` on a fork of the cache file `path` (the file unchanged)."""
    with lip.kv_open(path) as kv:
        fork = lip.kv_fork(kv)
    logits = lip.pred(fork, [token]).logits.copy()
    lip.kv_free(fork)
    return logits


def tiled_export(blob: bytes, times: int) -> bytes:
    """A predd export whose entries are `blob`'s repeated `times` times, at positions
    0..n-1: a long cache without the minutes a CPU takes to prefill one. Knows the
    export layout of predd/memory/kvstore.py (magic, u32 header length, msgpack, raw K/V,
    u32 CRC-32 of all that)."""
    import zlib

    import msgpack
    import numpy as np
    magic = b"SYKV2\n"
    assert blob.startswith(magic)
    blob = blob[:-4]
    (head_len,) = struct.unpack_from("<I", blob, len(magic))
    at = len(magic) + 4
    meta = msgpack.unpackb(blob[at:at + head_len])
    kv = np.frombuffer(blob, dtype=np.dtype(meta["numpy_dtype"]), offset=at + head_len)
    kv = kv.reshape(meta["shape"])
    tiled = np.ascontiguousarray(np.concatenate([kv] * times, axis=2))
    n = meta["length"] * times
    meta.update(length=n, shape=list(tiled.shape), tokens=meta["tokens"] * times,
                positions=list(range(n)))
    head = msgpack.packb(meta)
    out = magic + struct.pack("<I", len(head)) + head + tiled.tobytes()
    return out + struct.pack("<I", zlib.crc32(out))


# ---------------------------------------------------------------- another uid

NOBODY = 65534
FD = "<fd>"          # in a syscall step: the descriptor the last "open" returned


def fd(i: int) -> str:
    """In a syscall step: the descriptor the i-th "open" step (from 0) returned."""
    return f"<fd{i}>"


def syscalls(*steps, uid: int = NOBODY, gid: int = NOBODY, cwd: str | None = None,
             timeout: float = 60.0) -> list:
    """Run os calls as `uid` in a forked child of the test process and return, per step,
    its result (repr-able: ints, bytes, lists) or `-errno`. A step is `(name, *args)`
    naming a function of `os`; `FD` stands for the last opened descriptor and `fd(i)` for
    the i-th; an "open" step returns "fd". After setresuid the child only makes these
    calls (no imports: the venv's interpreter is not readable by other uids), then
    _exit()s. A child still running after `timeout` seconds is killed (the test fails)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                            # the child: syscalls only
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            if cwd is not None:
                os.chdir(cwd)
            fds, out = {FD: -1}, []
            for name, *args in steps:
                args = [fds.get(a, -1) if isinstance(a, str) and a.startswith("<fd")
                        else a for a in args]
                try:
                    value = getattr(os, name)(*args)
                except OSError as exc:
                    out.append(-(exc.errno or 0))
                    value = -1
                    if name != "open":
                        continue
                if name == "open":
                    fds[f"<fd{len(fds) - 1}>"] = fds[FD] = value
                    if value < 0:
                        continue
                    value = "fd"
                out.append(value)
            os.write(w, repr(out).encode())
        except BaseException as exc:
            os.write(w, repr(f"child failed: {type(exc).__name__}: {exc}").encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while select.select([r], [], [], max(deadline - time.monotonic(), 0))[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"syscalls {steps} did not finish in {timeout:g} s")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    result = ast.literal_eval(b"".join(chunks).decode())
    assert isinstance(result, list), result
    return result


def err(code: int) -> int:
    """What `syscalls` reports for a step that failed with `code`."""
    return -code


def revoked(lip, cap: str) -> bool:
    """Whether predd answers EBADF for `cap` (revoked, or never issued)."""
    try:
        lip.kv_stat(lip.KV.from_capability(cap))
    except lip.LipError as exc:
        return exc.code == "EBADF"
    return False
