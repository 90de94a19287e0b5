"""A LIP and `lip` over two replicas: a program on replica A that opens a file homed on
B brings it over (kvfsd's rehome: counted, same logits), or — when the file is open
elsewhere — works on it where it is; files made from the shell spread over the
replicas, and `lip` works on them where they are; `lip rehome`, `lip run --near` and
`lip stats`."""
import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from symphony_protocol import descriptor
from liblip.client import Client
from tests.conftest import ROOT
from tests.integration.kvfs_fixtures import finish, start_kvfsd
from tests.integration.kvfsd.test_kvfs_replicas import (facts, home, make_on, migrations, on,
                                                  replicas)  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow

PROGRAM = """\
import json, sys
import numpy as np
import liblip as lip
kv = lip.kv_open(sys.argv[1])
fork = lip.kv_fork(kv)
logits = lip.pred(fork, [int(sys.argv[2])]).logits
np.save(sys.argv[3], logits)
print(json.dumps({"replica": kv.replica, "tokens": lip.kv_tokens(kv)}))
"""


def run(args: list[str], addr: str, mount: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREDD_ADDR": addr, "KVFS_MOUNT": mount, "PYTHONPATH": ROOT}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def lip_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "liblip.cli", *args]


def test_a_program_brings_a_file_to_its_replica_or_uses_it_where_it_is(replicas, tmp_path):
    a, b = replicas
    A, B = a.addr, b.addr
    kvfs = start_kvfsd(A, str(tmp_path / "state"), "--predd", B)
    m = kvfs.mount
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    try:
        tokens = on(A).tokenize("A document kept on replica B, read from replica A.")
        probe = on(A).tokenize(" next")[0]
        doc = os.path.join(m, "doc.kv")
        make_on(B, doc, tokens)
        assert home(doc) == B
        want_tokens, want_logits, size = facts(doc, probe)

        # A program on A opens it: kvfsd moves it to A first (one migration).
        out = run([sys.executable, str(prog), "doc.kv", str(probe), str(tmp_path / "a.npy")],
                  A, m)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"replica": A, "tokens": want_tokens}
        assert np.array_equal(np.load(tmp_path / "a.npy"), want_logits)
        assert home(doc) == A and migrations(m) == f"1 {size}"

        # `lip rehome` sends it back; `lip run --near` starts a program on its replica.
        out = run(lip_cmd("rehome", "doc.kv", "--to", B), A, m)
        assert (out.returncode, out.stdout) == (0, f"doc.kv: {B}\n"), out.stderr
        assert home(doc) == B and migrations(m) == f"2 {2 * size}"
        out = run(lip_cmd("run", "--near", "doc.kv", "--", sys.executable, "-c",
                          "import os; print(os.environ['PREDD_ADDR'])"), A, m)
        assert (out.returncode, out.stdout) == (0, f"{B}\n"), out.stderr

        # Open elsewhere, it cannot move (EBUSY): the program works on it on B.
        held = os.open(doc, os.O_RDONLY)
        try:
            out = run([sys.executable, str(prog), "doc.kv", str(probe),
                       str(tmp_path / "b.npy")], A, m)
        finally:
            os.close(held)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"replica": B, "tokens": want_tokens}
        assert np.array_equal(np.load(tmp_path / "b.npy"), want_logits)
        assert home(doc) == B and migrations(m) == f"2 {2 * size}"

        # `lip stats` shows both replicas and the moves.
        out = run(lip_cmd("stats"), A, m)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert [(r["addr"], r["up"], r["files"]) for r in stats["replicas"]] == [
            (A, True, 0), (B, True, 1)]
        assert stats["migrations"] == {"count": 2, "bytes": 2 * size}
        out = run(lip_cmd("rehome", "doc.kv", "--to", "ipc:///nowhere.sock"), A, m)
        assert (out.returncode, out.stdout) == (1, "")
        assert out.stderr.startswith("lip: EINVAL: ")
    finally:
        assert finish(kvfs) == 0


def test_files_made_from_the_shell_are_spread_and_lip_works_on_them_where_they_are(
        replicas, tmp_path):
    """Six caches made with `lip prefill` go to the two replicas in turn; `lip generate`
    and `lip cat` run on each file's home replica (nothing moves), and the replicas'
    greedy continuations agree."""
    a, b = replicas
    A, B = a.addr, b.addr
    kvfs = start_kvfsd(A, str(tmp_path / "state"), "--predd", B)
    m = kvfs.mount
    text = "The capital of France is"
    try:
        for i in range(6):
            out = run(lip_cmd("prefill", f"f{i}.kv", text), A, m)
            assert out.returncode == 0, out.stderr
        names = [os.path.join(m, f"f{i}.kv") for i in range(6)]
        assert [home(n) for n in names] == [A, B, A, B, A, B]
        outputs = []
        for i in range(6):
            out = run(lip_cmd("generate", f"f{i}.kv", "--max-tokens", "4"), A, m)
            assert out.returncode == 0, out.stderr
            outputs.append(out.stdout)
        assert len(set(outputs)) == 1 and outputs[0].strip()
        out = run(lip_cmd("cat", "f1.kv"), B, m)
        assert out.returncode == 0, out.stderr
        assert out.stdout == text + outputs[0].removesuffix("\n")
        assert [home(n) for n in names] == [A, B, A, B, A, B]
        assert migrations(m) == "0 0"
        out = run(lip_cmd("stats"), A, m)
        stats = json.loads(out.stdout)
        assert [(r["addr"], r["files"]) for r in stats["replicas"]] == [(A, 3), (B, 3)]
    finally:
        assert finish(kvfs) == 0


def test_kvfsd_keeps_files_on_a_tcp_predd_with_a_trusted_token(tmp_path):
    """A replica on another host, here on loopback: predd on tcp with --auth-keys, kvfsd
    with that predd's trusted token in $SYMPHONY_TOKEN. With a plain token kvfsd may not
    keep caches there (persistent capabilities are for trusted sessions): EPERM."""
    from predd.worker.tp import free_port
    from tests.conftest import start_predd
    trusted, plain = "a-trusted-token-for-kvfsd", "a-plain-token-of-a-user"
    keys = tmp_path / "keys.tsv"
    keys.write_text(f"{trusted} {os.geteuid()} trusted kvfsd on host A\n{plain} 1000\n")
    keys.chmod(0o600)
    addr = f"tcp://127.0.0.1:{free_port()}"
    daemon = start_predd(str(tmp_path / "p"), "--addr", addr, "--auth-keys", str(keys),
                         "--kv-pages", "64", "--threads", "1")
    try:
        kvfs = start_kvfsd(addr, str(tmp_path / "state"), env={"SYMPHONY_TOKEN": trusted})
        try:
            a = os.path.join(kvfs.mount, "a.kv")
            open(a, "w").close()
            assert home(a) == addr
            fd = os.open(a, os.O_RDWR)
            try:
                desc = descriptor.parse(os.pread(fd, 4096, 0))
                assert (desc.replica, desc.rights) == (addr, "rw")
                user = Client(addr, token=plain)       # a LIP elsewhere, as uid 1000
                try:
                    user.call("pred", cap=desc.cap, tokens=[1, 2, 3])
                finally:
                    user.close()
            finally:
                os.close(fd)
            assert os.getxattr(a, "user.kv.tokens") == b"3"
        finally:
            assert finish(kvfs) == 0
        kvfs = start_kvfsd(addr, str(tmp_path / "state2"), env={"SYMPHONY_TOKEN": plain})
        try:
            b = os.path.join(kvfs.mount, "b.kv")
            with pytest.raises(OSError) as err:
                open(b, "w").close()
            assert err.value.errno == errno.EPERM
        finally:
            assert finish(kvfs) == 0
    finally:
        assert daemon.stop() == 0
