"""`lip run --near` and `lip stats` over replicas: which replica the files name, and the
mount root's replica lines as JSON (kvfsd's xattrs faked here; the real ones are tested
in tests/integration/kvfsd/test_kvfs_replicas.py)."""
from __future__ import annotations

import pytest

from liblip import cli
from liblip.client import LipError

A, B = "ipc:///run/symphony/predd.sock", "ipc:///run/symphony/predd-1.sock"


@pytest.fixture
def xattrs(monkeypatch, tmp_path):
    table: dict[tuple[str, str], str] = {}
    monkeypatch.setattr(cli, "_xattr", lambda path, name: table.get((path, name), ""))
    monkeypatch.setenv("KVFS_MOUNT", str(tmp_path))
    return table


def test_near_picks_the_replica_holding_most_tokens(xattrs):
    xattrs.update({("/m/a.kv", "user.kv.replica"): A, ("/m/a.kv", "user.kv.tokens"): "100",
                   ("/m/b.kv", "user.kv.replica"): B, ("/m/b.kv", "user.kv.tokens"): "60",
                   ("/m/c.kv", "user.kv.replica"): B, ("/m/c.kv", "user.kv.tokens"): "60"})
    assert cli.home_of(["/m/a.kv"]) == A
    assert cli.home_of(["/m/a.kv", "/m/b.kv"]) == A
    assert cli.home_of(["/m/a.kv", "/m/b.kv", "/m/c.kv"]) == B
    assert cli.home_of(["/m/b.kv", "/m/x.kv"]) == B          # not a cache file: ignored
    with pytest.raises(LipError) as err:
        cli.home_of(["/m/x.kv"])
    assert err.value.code == "EINVAL"


def test_stats_reads_the_replicas_of_the_mount_root(xattrs, tmp_path):
    assert cli.replicas() == {}                                # one predd: nothing added
    xattrs[(str(tmp_path), "user.kv.replicas")] = (
        f"{A} up files=3 pages=10/4096 calls=5\n{B} down files=1 pages=0/4096 calls=0\n")
    xattrs[(str(tmp_path), "user.kv.migrations")] = "2 1572864"
    assert cli.replicas() == {
        "replicas": [{"addr": A, "up": True, "files": 3, "pages_used": 10,
                      "pages_total": 4096, "calls": 5},
                     {"addr": B, "up": False, "files": 1, "pages_used": 0,
                      "pages_total": 4096, "calls": 0}],
        "migrations": {"count": 2, "bytes": 1572864}}
