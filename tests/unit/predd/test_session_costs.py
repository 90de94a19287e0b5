"""Per-session costs in `ps`: what each session's calls computed and reused, kept a
while after the session ends (the gateway reads a run's cost from them)."""
from tests.unit.engine_fakes import Harness

A, B = b"client-a", b"client-b"


def _row(rows: list[dict], sid: int) -> dict:
    (row,) = [r for r in rows if r["session"] == sid]
    return row


def test_ps_shows_each_sessions_tokens_and_keeps_them_after_bye():
    h = Harness()
    sid_a = h.ok(A, "hello")["session"]
    sid_b = h.ok(B, "hello")["session"]
    kv = h.ok(A, "kv_create")["cap"]
    h.ok(A, "pred", cap=kv, tokens=[1, 2, 3, 4, 5])             # 5 computed, 0 reused
    h.ok(A, "pred", cap=kv, tokens=[6, 7])                      # 2 computed, 5 reused
    fork = h.ok(B, "kv_fork", cap=kv)["cap"]
    h.ok(B, "pred", cap=fork, tokens=[8])                       # 1 computed, 7 reused
    rows = h.ok(A, "ps")["sessions"]
    assert {k: _row(rows, sid_a)[k] for k in ("tokens_computed", "tokens_reused")} == \
        {"tokens_computed": 7, "tokens_reused": 5}
    assert {k: _row(rows, sid_b)[k] for k in ("tokens_computed", "tokens_reused")} == \
        {"tokens_computed": 1, "tokens_reused": 7}
    h.ok(B, "bye")
    ps = h.ok(A, "ps")
    assert sid_b not in {r["session"] for r in ps["sessions"]}
    ended = _row(ps["ended"], sid_b)
    assert (ended["tokens_computed"], ended["tokens_reused"]) == (1, 7)
