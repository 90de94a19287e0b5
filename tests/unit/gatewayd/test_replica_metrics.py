"""/metrics over replicas without a predd: figures summed per replica (histograms bucket
by bucket), per-replica up and in-flight gauges, kvfsd's migrations (gatewayd/metrics.py)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gatewayd.daemons import Daemon
from gatewayd.metrics import Metrics, _add, read_migrations
from gatewayd.replicas import Replica, Replicas
from liblip.client import LipError

HIST = {"le_ms": [1, 10], "cumulative": [2, 5], "sum_ms": 30.0}


def stats(pages_used: int) -> dict:
    return {"pages_total": 512, "pages_used": pages_used, "steps": 10, "calls": 40,
            "mean_batch": 4.0, "queue_wait_hist": dict(HIST, cumulative=[2, 5]),
            "tiers": {"device": {"pages_total": 512, "pages_used": pages_used}},
            "logits_rows": {"buffer": pages_used, "frame": 1}, "batch_picks_failed": 1,
            "answered_in_flight": 3}


class FakeReplica(Replica):
    answer: dict | None = None

    def call(self, op, timeout=None, **fields):
        if self.answer is None:
            raise LipError("EIO", "down")
        return self.answer


def samples(metrics: Metrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_add_sums_numbers_histograms_and_tiers():
    total: dict = {}
    _add(total, stats(3))
    _add(total, stats(4))
    assert total["pages_used"] == 7 and total["pages_total"] == 1024
    assert total["queue_wait_hist"] == {"le_ms": [1, 10], "cumulative": [4, 10],
                                        "sum_ms": 60.0}
    assert total["tiers"] == {"device": {"pages_total": 1024, "pages_used": 7}}
    assert total["logits_rows"] == {"buffer": 7, "frame": 2}


def test_replica_metrics(tmp_path):
    r0 = FakeReplica(0, "ipc:///r/predd.sock", Daemon("predd[0]", []), up=True)
    r1 = FakeReplica(1, "ipc:///r/predd-1.sock", Daemon("predd[1]", []), up=True)
    r0.answer, r1.answer = stats(3), stats(4)
    rs = Replicas([r0, r1], print)
    rs.take(1)
    m = samples(Metrics(rs, str(tmp_path)))
    assert m[("symphony_replica_up", (("replica", r0.addr),))] == 1.0
    assert m[("symphony_replica_runs", (("replica", r1.addr),))] == 1.0
    assert m[("symphony_replica_runs", (("replica", r0.addr),))] == 0.0
    assert m[("symphony_predd_up", ())] == 1.0
    assert m[("symphony_kv_pages_used", ())] == 7.0
    assert m[("symphony_mean_batch", ())] == 4.0
    assert m[("symphony_queue_wait_seconds_count", ())] == 10.0
    assert m[("symphony_logits_rows_total", (("via", "buffer"),))] == 7.0
    assert m[("symphony_logits_rows_total", (("via", "frame"),))] == 2.0
    assert m[("symphony_batch_picks_failed_total", ())] == 2.0
    assert m[("symphony_answered_in_flight_total", ())] == 6.0
    assert m[("symphony_kv_migrations_total", ())] == 0.0     # tmp_path has no such xattr
    r1.up = False                         # a local replica known down is not asked
    r1.answer = stats(100)
    m = samples(Metrics(rs, str(tmp_path)))
    assert m[("symphony_replica_up", (("replica", r1.addr),))] == 0.0
    assert m[("symphony_predd_up", ())] == 0.0
    assert m[("symphony_kv_pages_used", ())] == 3.0


def test_read_migrations(tmp_path, monkeypatch):
    import gatewayd.metrics as metrics
    monkeypatch.setattr(metrics.os, "getxattr", lambda path, name: b"3 1572864")
    assert read_migrations(str(tmp_path)) == (3, 1572864)
    monkeypatch.setattr(metrics.os, "getxattr", lambda path, name: b"garbage")
    assert read_migrations(str(tmp_path)) == (0, 0)
