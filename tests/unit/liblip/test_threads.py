"""liblip.threads.run_threads: every branch runs and is waited for, one alone on the
caller's thread, several on threads of their own; the first error is raised after all
have ended."""
from __future__ import annotations

import threading

import pytest

from liblip.threads import run_threads


@pytest.mark.parametrize("count", [0, 1, 3])
def test_each_branch_runs_once_and_all_end_before_it_returns(count):
    ran: dict[int, int] = {}
    run_threads(lambda i: ran.__setitem__(i, threading.get_ident()), count)
    assert sorted(ran) == list(range(count))
    here = threading.get_ident()
    assert all((ident == here) == (count == 1) for ident in ran.values())


def test_the_first_error_is_raised_once_every_branch_has_ended():
    ended: list[int] = []

    def work(i: int) -> None:
        if i == 1:
            raise ValueError("branch 1")
        ended.append(i)
    with pytest.raises(ValueError, match="branch 1"):
        run_threads(work, 3)
    assert sorted(ended) == [0, 2]
    with pytest.raises(ValueError, match="branch 1"):
        run_threads(lambda i: work(1), 1)


def test_a_thread_that_cannot_start_is_raised_after_the_started_ones_end(monkeypatch):
    gate, ended = threading.Event(), []
    real_start, starts = threading.Thread.start, []

    def start(self):
        starts.append(self)
        if len(starts) == 3:
            gate.set()                  # the first two may end only now
            raise RuntimeError("can't start new thread")
        real_start(self)
    monkeypatch.setattr(threading.Thread, "start", start)

    def work(i: int) -> None:
        gate.wait(10)
        threading.Event().wait(0.2)     # still running a while after the failed start
        ended.append(i)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        run_threads(work, 4)
    assert sorted(ended) == [0, 1] and len(starts) == 3
