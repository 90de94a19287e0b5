"""The scheduler as pure bookkeeping: a fake runner loop and exact plans.

A plan is written as [(cid, start, count), ...] in the order the scheduler chose.
Times are binary fractions so that wait times compare exactly.
"""
from __future__ import annotations

import math

import pytest

from predd.engine.calls import Call
from predd.engine.return_times import ReturnTimes
from predd.engine.scheduler import Plan, PlanItem, Scheduler, SchedulerConfig, StepCost


def make(token_budget=512, max_batch=64, wait_factor=0.5, max_wait_s=0.25,
         latency_factor=0.0, active_s=0.5) -> Scheduler:
    return Scheduler(SchedulerConfig(token_budget=token_budget, max_batch=max_batch,
                                     wait_factor=wait_factor, max_wait_s=max_wait_s,
                                     latency_factor=latency_factor,
                                     active_s=active_s))


class Runner:
    """The engine's side of a step: run the plan, grow generate calls, report finished.

    A generate call produces one token each time it catches up and finishes at its
    `max_tokens`-th (the engine grows `total` by one per token it feeds back).
    """

    def __init__(self, sched: Scheduler, admit=lambda call: True, step_time=0.25) -> None:
        self.sched = sched
        self.admit = admit
        self.now = 0.0
        self.step_time = step_time   # seconds, or a function of the step's tokens

    def step(self, step_time: float | None = None) -> list[tuple[int, int, int]]:
        plan = self.sched.schedule(self.admit)
        if step_time is None:
            step_time = self.step_time(plan.num_tokens) if callable(self.step_time) \
                else self.step_time
        finished = set()
        for item in plan.items:
            call = item.call
            if not item.completes:
                continue
            if call.generating:
                call.generated.append(0)
            if call.generating and len(call.generated) < call.max_tokens:
                call.total += 1
            else:
                finished.add(call.cid)
        self.now += step_time
        self.sched.update(plan, finished, self.now, step_time)
        return [(i.call.cid, i.start, i.count) for i in plan.items]

    def drain(self, limit: int = 100) -> list[list[tuple[int, int, int]]]:
        steps = []
        while self.sched.pending() and len(steps) < limit:
            steps.append(self.step())
        return steps


def submit(sched, session, oid, total, now=0.0, generate=0, uid=0) -> Call:
    return sched.submit(Call(session, oid, total, generating=bool(generate),
                             max_tokens=generate, uid=uid), now)


# ---------------------------------------------------------------- records

def test_records():
    call = Call(1, 7, total=10, computed=4)
    assert call.remaining == 6
    item = PlanItem(call, 4, 6)
    assert item.completes
    assert not PlanItem(call, 4, 5).completes
    assert Plan([item, PlanItem(call, 0, 3)]).num_tokens == 9
    assert Plan().num_tokens == 0


def test_submit_numbers_calls_and_tracks_busy_objects():
    s = make()
    a = submit(s, 1, 10, 5, now=2.5)
    b = submit(s, 1, 11, 5)
    c = submit(s, 2, 10, 5)
    assert (a.cid, b.cid, c.cid) == (1, 2, 3)
    assert a.arrival == 2.5
    assert s.busy(10) and s.busy(11) and not s.busy(12)
    assert s.pending() == 3


# ---------------------------------------------------------------- plans

def test_one_call_under_budget_runs_in_one_step():
    s = make()
    submit(s, 1, 10, 100)
    r = Runner(s)
    assert r.step() == [(1, 0, 100)]
    assert s.pending() == 0 and not s.busy(10)
    assert r.step() == []


def test_chunked_prefill_splits_a_long_call():
    s = make(token_budget=4)
    call = submit(s, 1, 10, 10)
    r = Runner(s)
    assert r.step() == [(1, 0, 4)]
    assert call.computed == 4 and s.busy(10)
    assert r.step() == [(1, 4, 4)]
    assert r.step() == [(1, 8, 2)]
    assert call.computed == 10 and not s.busy(10)


def test_budget_is_shared_and_the_second_call_gets_a_chunk():
    s = make(token_budget=10)
    submit(s, 1, 10, 6)
    submit(s, 1, 11, 6)
    r = Runner(s)
    assert r.drain() == [[(1, 0, 6), (2, 0, 4)], [(2, 4, 2)]]


def test_max_batch():
    s = make(max_batch=2)
    for oid in (10, 11, 12):
        submit(s, 1, oid, 3)
    r = Runner(s)
    assert r.drain() == [[(1, 0, 3), (2, 0, 3)], [(3, 0, 3)]]


def test_calls_on_one_object_run_one_at_a_time_in_arrival_order():
    s = make(token_budget=4)
    submit(s, 1, 10, 6)
    submit(s, 2, 10, 1)        # same object, another session, short: still waits
    submit(s, 1, 10, 2)
    submit(s, 1, 11, 1)
    r = Runner(s)
    assert r.drain() == [
        [(4, 0, 1), (1, 0, 3)],
        [(1, 3, 3)],
        [(2, 0, 1)],
        [(3, 0, 2)],
    ]


def test_short_calls_go_first():
    s = make(token_budget=8)
    submit(s, 1, 10, 10)       # long, first to arrive
    submit(s, 1, 11, 1)        # decode
    submit(s, 2, 12, 1)        # decode, other session
    r = Runner(s)
    assert r.step() == [(2, 0, 1), (3, 0, 1), (1, 0, 6)]
    assert r.step() == [(1, 6, 4)]


def test_a_nearly_done_chunked_call_counts_as_short():
    s = make(token_budget=4)
    submit(s, 1, 10, 5)
    submit(s, 1, 11, 3)
    r = Runner(s)
    # cid 1 runs 4, then has 1 left: it now goes before cid 2's remaining 3.
    assert r.drain() == [[(1, 0, 4)], [(1, 4, 1), (2, 0, 3)]]


def test_round_robin_across_sessions_when_over_budget():
    s = make(token_budget=4)
    submit(s, 1, 10, 8)
    submit(s, 2, 20, 8)
    r = Runner(s)
    assert r.drain() == [[(1, 0, 4)], [(2, 0, 4)], [(1, 4, 4)], [(2, 4, 4)]]


def test_round_robin_of_decodes_over_budget():
    s = make(token_budget=2)
    for session in (1, 2, 3):
        submit(s, session, 10 * session, 1, generate=3)   # three tokens each
    r = Runner(s)
    assert [r.step() for _ in range(3)] == [
        [(1, 0, 1), (2, 0, 1)],
        [(2, 1, 1), (3, 0, 1)],
        [(3, 1, 1), (1, 1, 1)],
    ]


def test_round_robin_puts_each_session_first_in_turn():
    s = make(token_budget=3)
    for session in (5, 7, 9):                 # ids need not be contiguous
        submit(s, session, session, 1, generate=10)
        submit(s, session, 100 + session, 1, generate=10)
    r = Runner(s)
    firsts = [r.step()[0][0] for _ in range(6)]
    assert firsts == [1, 3, 5, 1, 3, 5]


def test_a_session_with_many_objects_does_not_starve_another():
    s = make(token_budget=2)
    for oid in range(10, 16):
        submit(s, 1, oid, 1)                  # six decodes of session 1
    submit(s, 2, 99, 1)                       # one of session 2, last to arrive
    r = Runner(s)
    assert r.step() == [(1, 0, 1), (7, 0, 1)]  # sessions interleave
    assert r.step() == [(2, 0, 1), (3, 0, 1)]


def test_generate_call_grows_and_stays_queued_until_finished():
    s = make()
    call = submit(s, 1, 10, 5, generate=3)
    r = Runner(s)
    assert r.drain() == [[(1, 0, 5)], [(1, 5, 1)], [(1, 6, 1)]]
    assert call.total == 7 and call.computed == 7
    assert s.expected == set()                # a finished generate is not waited for


def test_a_caught_up_generate_call_is_not_eligible_and_blocks_its_object():
    s = make()
    call = submit(s, 1, 10, 2, generate=5)
    submit(s, 1, 10, 3)
    plan = s.schedule()
    s.update(plan, set(), 1.0, 0.25)          # the engine did not grow it (yet)
    assert call.remaining == 0
    assert s.schedule().items == []
    assert s.wait_time(1.0) is None
    call.total += 1
    assert [(i.call.cid, i.start, i.count) for i in s.schedule().items] == [(1, 2, 1)]


# ---------------------------------------------------------------- admission

def test_admit_is_asked_once_per_call_before_its_first_chunk():
    s = make(token_budget=4)
    asked = []
    r = Runner(s, admit=lambda call: asked.append(call.cid) or True)
    submit(s, 1, 10, 10)
    submit(s, 1, 11, 2)
    r.drain()
    assert asked == [1, 2]


def test_admit_is_not_asked_past_max_batch_or_budget():
    s = make(token_budget=3, max_batch=2)
    asked = []
    r = Runner(s, admit=lambda call: asked.append(call.cid) or True)
    for oid in (10, 11, 12, 13):
        submit(s, 1, oid, 1)
    assert r.step() == [(1, 0, 1), (2, 0, 1)]
    assert asked == [1, 2]


def test_a_refused_call_leaves_the_queue_and_frees_its_slot():
    s = make(token_budget=4, max_batch=2)
    refused = submit(s, 1, 10, 1)
    submit(s, 1, 10, 2)                       # behind the refused one, same object
    submit(s, 1, 11, 1)
    submit(s, 1, 12, 1)
    r = Runner(s, admit=lambda call: call is not refused)
    assert r.step() == [(3, 0, 1), (4, 0, 1)]
    assert s.pending() == 1 and s.busy(10)
    assert r.step() == [(2, 0, 2)]
    assert not refused.admitted and s.pending() == 0


# ---------------------------------------------------------------- adaptive launch

def test_wait_time_nothing_to_run():
    s = make()
    assert s.wait_time(0.0) is None


def test_wait_time_launches_at_once_when_nothing_is_expected():
    s = make()
    submit(s, 1, 10, 3)
    assert s.expected == set()
    assert s.wait_time(0.0) == 0.0


def test_wait_for_programs_of_the_last_step_up_to_the_deadline():
    s = make(wait_factor=0.5, max_wait_s=0.25)
    submit(s, 1, 10, 3)
    submit(s, 2, 20, 3)
    s.update(s.schedule(), {1, 2}, now=2.0, step_time=0.25)
    assert s.expected == {10, 20}
    submit(s, 3, 30, 1, now=2.0)              # someone else is ready
    assert s.wait_time(2.0) == 0.125          # 0.5 * step time
    assert s.wait_time(2.0625) == 0.0625
    assert s.wait_time(2.125) == 0.0
    assert s.wait_time(3.0) == 0.0
    submit(s, 1, 10, 1, now=2.0625)           # one program answered
    assert s.expected == {20}
    assert s.wait_time(2.0625) == 0.0625
    submit(s, 2, 20, 1, now=2.09375)          # all answered: go
    assert s.expected == set()
    assert s.wait_time(2.09375) == 0.0


def test_wait_is_capped_by_max_wait():
    s = make(wait_factor=0.5, max_wait_s=0.25)
    submit(s, 1, 10, 3)
    s.update(s.schedule(), {1}, now=5.0, step_time=2.0)
    submit(s, 2, 20, 1, now=5.0)
    assert s.wait_time(5.0) == 0.25


def step_all(s, now: float, step_time: float = 0.5) -> None:
    """One step that runs and finishes every queued call (each one token)."""
    plan = s.schedule()
    s.update(plan, {i.call.cid for i in plan.items}, now=now, step_time=step_time)


def test_the_hold_learns_from_calls_in_time_and_climbs_past_a_missed_one():
    """A call that comes during the hold gives its object's return time (a decaying
    maximum); one that misses it is handled after the step (predd has one thread), so
    it only raises its object's time to 1.25 times the hold it missed."""
    s = make(wait_factor=0.25, max_wait_s=1.0)            # hold 0.125 of a 0.5 s step
    for oid in (10, 20):
        submit(s, oid, oid, 1)
    step_all(s, now=1.0)
    assert s.expected == {10, 20} and s.wait_time(1.0) is None      # nothing queued
    submit(s, 10, 10, 1, now=1.0625)                      # in time: learned
    assert s.returns.times == {10: 0.0625} and s.wait_time(1.0625) == 0.0625
    step_all(s, now=2.0)                                  # 20 missed a hold of 0.125
    assert s.returns.times == {10: 0.0625, 20: 0.15625} and s.expected == {10}
    submit(s, 20, 20, 1, now=2.0)                         # handled after the step: no sample
    submit(s, 10, 10, 1, now=2.03125)
    assert s.returns.times == {10: 0.05, 20: 0.15625}          # 0.8 * 0.0625
    step_all(s, now=3.0)
    submit(s, 99, 99, 1, now=3.0)                         # another is ready
    assert s.wait_time(3.0) == 0.15625                    # until 20 is due, not 0.125
    submit(s, 20, 20, 1, now=3.125)                       # in time now: its own time
    assert s.returns.times[20] == 0.125 and s.wait_time(3.125) == 0.03125   # 10 still due
    submit(s, 10, 10, 1, now=3.125)
    assert s.expected == set() and s.wait_time(3.125) == 0.0          # all back: go
    s.forget(10)
    assert 10 not in s.returns.times


def run_loop(s, returns: list[float], steps: int, step_time: float = 0.5) -> list[int]:
    """predd's loop over `s` with one program per object, whose next call comes
    `returns[oid]` after the step that answered it: calls that come while a launch is
    held are handled as they come, those that come during a step after it. The batch
    size of every step."""
    arrivals: list[tuple[float, int]] = []
    for oid in range(len(returns)):
        submit(s, oid, oid, 1, now=0.0)
    now, sizes = 0.0, []
    for _ in range(steps):
        while True:
            wait = s.wait_time(now)
            come = arrivals[0][0] if arrivals else math.inf
            if wait is not None and now + wait <= come:
                now += wait
                break
            t, oid = arrivals.pop(0)
            now = max(now, t)
            submit(s, oid, oid, 1, now=now)
        plan = s.schedule()
        sizes.append(len(plan.items))
        now += step_time
        s.update(plan, {i.call.cid for i in plan.items}, now=now, step_time=step_time)
        late = [a for a in arrivals if a[0] <= now]       # came during the step
        arrivals = [a for a in arrivals if a[0] > now]
        for _, oid in late:
            submit(s, oid, oid, 1, now=now)
        arrivals = sorted(arrivals + [(now + returns[i.call.oid], i.call.oid)
                                      for i in plan.items])
    return sizes


def test_programs_slower_than_the_base_hold_end_up_in_one_batch():
    """16 programs answering 0.4-0.55 of a step after it (a GPU's short steps): with a
    hold of 0.25 of a step they would miss every launch and split into cohorts; the
    learned hold climbs until all of them make it."""
    returns = [0.2 + 0.005 * i for i in range(16)]        # 0.2 .. 0.275 s of a 0.5 s step
    sizes = run_loop(make(wait_factor=0.25, max_wait_s=1.0), returns, 80)[-40:]
    # (a hold of 0.25 of a step alone: 15, 1, 15, 1, ...: a mean of 8). The slowest tenth
    # is not waited for, so it sometimes runs a step later: 14-16 a step.
    assert min(sizes) >= 14 and sum(sizes) / len(sizes) >= 14.5


def test_the_learned_hold_waits_for_nine_in_ten_and_at_most_a_step():
    s = make(wait_factor=0.25, max_wait_s=1.0)
    for oid in range(1, 11):
        submit(s, oid, oid, 1)
    step_all(s, now=1.0)
    for oid in range(1, 11):                  # returns 1/32 ... 10/32 s after the step
        submit(s, oid, oid, 1, now=1.0 + oid / 32)
    step_all(s, now=2.0)
    submit(s, 99, 99, 1, now=2.0)
    assert s.wait_time(2.0) == 9 / 32         # the 9th of 10, not the slowest
    s2 = make(wait_factor=0.25, max_wait_s=0.1875)
    submit(s2, 1, 1, 1)
    step_all(s2, now=1.0)
    submit(s2, 1, 1, 1, now=1.4375)
    step_all(s2, now=2.0)
    submit(s2, 2, 2, 1, now=2.0)
    assert s2.wait_time(2.0) == 0.125         # 0.4375 is past max_wait_s: not waited for
    s3 = make(wait_factor=0.25, max_wait_s=1.0)
    submit(s3, 1, 1, 1)
    step_all(s3, now=1.0)
    submit(s3, 1, 1, 1, now=1.4375)
    step_all(s3, now=2.0, step_time=0.375)    # 0.4375 is more than a step of 0.375
    submit(s3, 2, 2, 1, now=2.0)
    assert s3.wait_time(2.0) == 0.09375       # not waited for: wait_factor's 0.25 * 0.375
    r, ten = ReturnTimes(), range(1, 11)      # ten expected, none timed yet: due at once
    r.times = {1: 0.46875}                    # one slow (or hostile) object of ten
    assert r.plan(ten, 0.5, 0.25, 1.0) == 0.125          # cannot hold the other nine
    r.times[2] = 0.4375                       # two of ten: the 9th is due at 0.4375
    assert r.plan(ten, 0.5, 0.25, 1.0) == 0.4375
    r.times.update({1: math.inf, 2: math.inf})           # neither waited for: the 9th never
    assert r.plan(ten, 0.5, 0.25, 1.0) == 0.125


def test_no_wait_when_a_full_batch_is_waiting():
    s = make(max_batch=2, token_budget=100)
    submit(s, 1, 10, 1)
    s.update(s.schedule(), {1}, now=1.0, step_time=1.0)
    submit(s, 2, 20, 1)
    assert s.wait_time(1.0) == 0.25
    submit(s, 3, 30, 1)
    assert s.wait_time(1.0) == 0.0            # max_batch heads


def test_no_wait_when_the_budget_is_already_full():
    s = make(token_budget=8)
    submit(s, 1, 10, 1)
    s.update(s.schedule(), {1}, now=1.0, step_time=1.0)
    submit(s, 2, 20, 7)
    assert s.wait_time(1.0) == 0.25
    submit(s, 3, 30, 1)
    assert s.wait_time(1.0) == 0.0            # 8 tokens waiting


def test_only_finished_non_generate_calls_without_queued_successors_are_expected():
    s = make(token_budget=6)
    submit(s, 1, 10, 2)                       # finishes
    submit(s, 1, 11, 2)                       # finishes, but its object has a next call
    submit(s, 1, 11, 2)
    submit(s, 1, 12, 1, generate=2)           # generate: goes on, then finishes
    submit(s, 1, 13, 9)                       # chunked, not finished
    r = Runner(s)
    r.step()
    assert s.expected == {10}
    r.step()                                  # cid 3 finishes; generate finishes
    assert s.expected == {11}


def test_update_plans_the_hold_from_the_step_time_and_note_wait_accumulates():
    s = make()
    submit(s, 1, 10, 1)
    s.update(s.schedule(), {1}, now=4.0, step_time=0.5)
    assert (s.last_step_end, s.returns.hold_s) == (4.0, 0.25)   # 0.5 x 0.5 s, max_wait_s
    s.note_wait(0.25)
    s.note_wait(0.125)
    assert s.waited_s == 0.375


# ---------------------------------------------------------------- cancel

def test_cancel_drops_matching_calls_and_their_expectation():
    s = make()
    submit(s, 1, 10, 1)
    s.update(s.schedule(), {1}, now=1.0, step_time=1.0)
    assert s.expected == {10}
    a = submit(s, 1, 11, 4)
    b = submit(s, 2, 20, 4)
    c = submit(s, 1, 11, 4)
    s.expected.add(11)                        # as if 11 had been expected too
    dropped = s.cancel(lambda call: call.session == 1)
    assert dropped == [a, c]
    assert not s.busy(11) and s.busy(20) and s.pending() == 1
    assert s.expected == {10}
    assert [(i.call.cid, i.start, i.count) for i in s.schedule().items] == [(b.cid, 0, 4)]
    assert s.cancel(lambda call: False) == []


def test_cancel_in_the_middle_of_a_chunked_call():
    s = make(token_budget=4)
    submit(s, 1, 10, 10)
    submit(s, 2, 20, 2)
    r = Runner(s)
    r.step()
    s.cancel(lambda call: call.oid == 10)
    assert r.drain() == [[(2, 0, 2)]]


def test_forget_stops_waiting_for_an_object():
    s = make()
    submit(s, 1, 10, 1)
    s.update(s.schedule(), {1}, now=1.0, step_time=1.0)
    submit(s, 2, 20, 1)
    assert s.wait_time(1.0) == 0.25
    s.forget(10)
    s.forget(99)
    assert s.wait_time(1.0) == 0.0


def test_remove_is_idempotent():
    s = make()
    a = submit(s, 1, 10, 1)
    s.remove(a)
    s.remove(a)
    assert s.pending() == 0 and not s.busy(10)


@pytest.mark.parametrize("budget,batch", [(1, 1), (3, 2), (7, 64), (64, 3)])
def test_every_token_of_every_call_is_computed_exactly_once(budget, batch):
    s = make(token_budget=budget, max_batch=batch)
    calls = [submit(s, session, oid, total, generate=gen)
             for session, oid, total, gen in [
                 (1, 10, 9, 0), (1, 10, 2, 0), (2, 20, 1, 4), (2, 21, 13, 0),
                 (3, 30, 5, 2), (3, 10, 3, 0), (4, 40, 1, 0)]]
    want = {c.cid: c.total + max(c.max_tokens, 1) - 1 for c in calls}
    seen: dict[int, list[int]] = {c.cid: [] for c in calls}
    r = Runner(s)
    for plan in r.drain():
        assert sum(count for _, _, count in plan) <= budget
        assert len(plan) <= batch
        assert len({c for c, _, _ in plan}) == len(plan)
        for cid, start, count in plan:
            assert start == len(seen[cid])
            seen[cid].extend(range(start, start + count))
    assert {cid: len(toks) for cid, toks in seen.items()} == want
    assert s.pending() == 0



# ---------------------------------------------------------------- fairness across uids

def test_a_uid_with_many_sessions_gets_one_share():
    s = make(token_budget=4)
    for session in range(1, 101):             # uid 7: a hundred sessions of decodes
        submit(s, session, session, 1, generate=50, uid=7)
    victim = submit(s, 500, 500, 1, generate=50, uid=8)
    r = Runner(s)
    for _ in range(20):
        plan = r.step()
        assert len(plan) == 4
        assert (victim.cid, victim.computed - 1, 1) in plan   # in every single step


def test_round_robin_across_uids_then_sessions():
    s = make(token_budget=3)
    # uid 1: sessions 1 and 2 with a decode each; uid 2: one session with two decodes.
    a1 = submit(s, 1, 10, 1, generate=9, uid=1)
    a2 = submit(s, 2, 20, 1, generate=9, uid=1)
    b1 = submit(s, 3, 30, 1, generate=9, uid=2)
    b2 = submit(s, 3, 31, 1, generate=9, uid=2)
    r = Runner(s)
    firsts = [[cid for cid, _, _ in r.step()] for _ in range(4)]
    assert firsts == [
        [a1.cid, b1.cid, a2.cid],     # uid 1 (session 1), uid 2, uid 1 (session 2)
        [b1.cid, a2.cid, b2.cid],     # uid 2 first; uid 1 starts with session 2
        [a1.cid, b1.cid, a2.cid],
        [b1.cid, a2.cid, b2.cid],
    ]


def test_within_a_uid_decodes_go_first_but_not_before_other_uids():
    s = make(token_budget=8)
    long = submit(s, 1, 10, 20, uid=1)        # uid 1: a long prompt
    dec = submit(s, 1, 11, 1, uid=1)          # and a decode
    other = submit(s, 2, 20, 6, uid=2)        # uid 2: a medium prompt
    r = Runner(s)
    # each uid may first take half the budget (4), then the rest goes in order
    assert r.step() == [(dec.cid, 0, 1), (other.cid, 0, 4), (long.cid, 0, 3)]
    assert r.step() == [(other.cid, 4, 2), (long.cid, 3, 6)]
    assert r.step() == [(long.cid, 9, 8)]


def test_queued_counts_per_session_and_uid():
    s = make(token_budget=4)
    a = submit(s, 1, 10, 2, uid=5)
    submit(s, 1, 10, 2, uid=5)
    submit(s, 2, 20, 2, uid=5)
    submit(s, 3, 30, 2, uid=6)
    assert (s.queued(session=1), s.queued(session=2), s.queued(session=9)) == (2, 1, 0)
    assert (s.queued(uid=5), s.queued(uid=6), s.queued(uid=9)) == (3, 1, 0)
    assert s.pending() == 4 and s.check() == []
    s.remove(a)
    s.remove(a)
    assert s.queued(session=1) == 1 and s.queued(uid=5) == 2 and s.pending() == 3
    s.cancel(lambda call: call.uid == 5)
    assert s.queued(uid=5) == 0 and s.queued(uid=6) == 1 and s.pending() == 1
    Runner(s).drain()
    assert s.pending() == 0 and s.queued(uid=6) == 0 and s.check() == []


# ---------------------------------------------------------------- latency bound

def test_step_cost_is_a_non_decreasing_curve_through_size_classes():
    cost = StepCost(rise=0.5)
    assert cost.predict(1) is None
    cost.observe(1, 0.010)
    assert cost.predict(1) is None            # one size class: no slope yet
    cost.observe(101, 0.060)
    assert cost.predict(1) == pytest.approx(0.010)
    assert cost.predict(51) == pytest.approx(0.035)
    assert cost.predict(201) == pytest.approx(0.110)    # extrapolated
    cost.observe(1, 0.030)                    # slower: follows by `rise` of the way
    assert cost.predict(1) == pytest.approx(0.020)
    cost.observe(1, 0.012)                    # faster: at once
    assert cost.predict(1) == pytest.approx(0.012)
    cost.observe(40, 0.001)                   # noise below a smaller step's time
    assert cost.predict(40) == pytest.approx(0.012)     # the curve never goes down
    cost.observe(1, 0.010)
    assert cost.tokens_within(0.060, 2048) == 101
    assert cost.tokens_within(0.0, 2048) == 1
    assert cost.tokens_within(10.0, 512) == 512


def linear(tokens: int) -> float:
    """A step costs 10 ms + 1 ms per token."""
    return 0.010 + 0.001 * tokens


def learned(s: Scheduler) -> Runner:
    """A runner whose steps cost `linear`, and a scheduler that has measured it."""
    s.cost.observe(1, linear(1))
    s.cost.observe(100, linear(100))
    return Runner(s, step_time=linear)


def test_a_flood_of_prompts_is_held_to_twice_the_victims_step():
    s = make(token_budget=512, latency_factor=2.0)
    r = learned(s)
    flood = [submit(s, 1, 10 + i, 400, uid=65534) for i in range(4)]
    victim = submit(s, 2, 99, 1, generate=5, uid=1000)
    # alone, the victim's decode costs 11 ms; a step may cost 22 ms: 12 tokens
    assert r.step() == [(victim.cid, 0, 1), (flood[0].cid, 0, 11)]
    # the flood's turn to go first: its share is 6 tokens, then it takes what is left
    assert r.step() == [(flood[0].cid, 11, 11), (victim.cid, 1, 1)]
    assert s.capped_steps == 2


def test_the_bound_is_off_for_a_single_uid_or_factor_zero():
    s = make(token_budget=512, latency_factor=2.0)
    r = learned(s)
    submit(s, 1, 10, 400, uid=65534)
    submit(s, 2, 11, 1, uid=65534)
    assert r.step() == [(2, 0, 1), (1, 0, 400)]
    s = make(token_budget=512, latency_factor=0.0)
    r = learned(s)
    submit(s, 1, 10, 400, uid=65534)
    submit(s, 2, 11, 1, uid=1000)
    assert r.step() == [(2, 0, 1), (1, 0, 400)]


def test_the_bound_waits_for_cost_measurements():
    s = make(token_budget=512, latency_factor=2.0)
    submit(s, 1, 10, 400, uid=65534)
    submit(s, 2, 11, 1, uid=1000)
    assert Runner(s).step() == [(2, 0, 1), (1, 0, 400)]


def test_a_uid_that_just_finished_a_call_still_counts_for_a_few_steps():
    """A pred loop: between its calls the victim has nothing queued, yet the flood
    stays bounded for `active_s` seconds after its last call ended."""
    s = make(token_budget=512, latency_factor=2.0, active_s=0.05)
    r = learned(s)
    submit(s, 2, 99, 1, uid=1000)             # the victim's pred of one token
    submit(s, 1, 10, 2000, uid=65534)
    r.step()                                  # ends at 22 ms: the victim's call is done
    steps = [[count for _, _, count in r.step()] for _ in range(4)]
    # steps ending at 44, 66 and 88 ms are planned within 50 ms of it: bounded
    assert steps == [[12], [12], [12], [512]]


def test_latency_bound_keeps_every_token_exactly_once():
    s = make(token_budget=64, latency_factor=1.5)
    r = learned(s)
    calls = [submit(s, i, 10 + i, total, generate=gen, uid=i % 3)
             for i, (total, gen) in enumerate([(90, 0), (1, 6), (30, 3), (7, 0), (1, 2)])]
    want = {c.cid: c.total + max(c.max_tokens, 1) - 1 for c in calls}
    seen: dict[int, int] = {c.cid: 0 for c in calls}
    for plan in r.drain(limit=500):
        for cid, start, count in plan:
            assert start == seen[cid]
            seen[cid] += count
    assert seen == want


def test_a_full_budget_still_waits_for_another_uids_pred_loop():
    s = make(token_budget=8, wait_factor=0.5, max_wait_s=0.25)
    submit(s, 1, 10, 1, uid=1000)                 # the victim's pred
    s.update(s.schedule(), {1}, now=1.0, step_time=0.25)
    submit(s, 2, 20, 100, uid=65534)              # a flood fills the budget
    assert s.wait_time(1.0) == 0.125              # the victim may join the next step
    submit(s, 1, 10, 1, now=1.0625, uid=1000)
    assert s.wait_time(1.0625) == 0.0
    s = make(token_budget=8, wait_factor=0.5, max_wait_s=0.25)
    submit(s, 1, 10, 1, uid=65534)                # the same uid as the flood: no wait
    s.update(s.schedule(), {1}, now=1.0, step_time=0.25)
    submit(s, 2, 20, 100, uid=65534)
    assert s.wait_time(1.0) == 0.0


def test_flood_decodes_do_not_starve_another_uids_prompt_under_the_bound():
    s = make(token_budget=512, latency_factor=2.0)
    r = learned(s)
    flood = [submit(s, 1, 100 + i, 1, generate=100, uid=65534) for i in range(40)]
    prompt = submit(s, 2, 99, 300, uid=1000)
    plan = r.step()
    # the smallest demand is the flood's 40 decodes (50 ms alone): a step may take
    # 100 ms, 90 tokens; each uid first gets 45, then the prompt takes what is left
    assert sum(n for _, _, n in plan) == 90
    assert dict((cid, n) for cid, _, n in plan)[prompt.cid] == 50
    assert all(c.computed == 1 for c in flood)


def test_the_bound_leaves_room_for_each_uids_least_demand():
    s = make(token_budget=512, latency_factor=1.0)
    s.cost.observe(1, 0.010)
    s.cost.observe(2, 0.030)                  # steep: one more token triples the time
    r = Runner(s, step_time=lambda n: 0.010 * n)
    for uid in (1, 2, 3):
        submit(s, uid, uid, 1, generate=2, uid=uid)
    submit(s, 4, 4, 50, uid=4)
    assert sorted(n for _, _, n in r.step()) == [1, 1, 1, 1]   # every uid gets its one


def test_feedback_shrinks_the_bound_when_steps_cost_more_than_predicted():
    """The curve knows 10 ms + 1 ms a token; real steps also pay 30 ms per call (say
    attention over a long context). Bounded steps overrun, so the bound shrinks until
    the flood gets its least; steps within the bound let it grow back."""
    s = make(token_budget=512, latency_factor=3.0)
    learned(s)
    r = Runner(s, step_time=lambda n: 0.010 + 0.001 * n + 0.030 * (n > 1))
    submit(s, 2, 99, 1, generate=40, uid=1000)
    submit(s, 1, 10, 5000, uid=65534)
    sizes = [sum(n for _, _, n in r.step()) for _ in range(16)]
    # bound 33 ms: 23 tokens predicted, but such a step takes 63 ms: the curve learns
    # that size, the scale shrinks; down to each uid's least (one token each)
    assert sizes == [23, 8, 3] + [2] * 13
    assert s.capped_steps == 16 and s._scale < 0.1
    s.cancel(lambda call: call.uid == 65534)
    for _ in range(30):                                        # the victim alone: within
        r.step()
    assert s._scale < 0.1                                      # unbounded steps: no change
