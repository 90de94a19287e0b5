"""When each KV object's next call comes after a step: what adaptive launch
(predd/engine/scheduler.py) holds the next launch for.

After a step, the objects whose calls finished in it are *expected* to send their next
call. `plan` sets the hold: `wait_factor` of the step, or, where the expected objects
come back later than that, until RETURN_QUANTILE of them are due, where that is within
RETURN_STEPS step times; always within `max_wait_s`. Each object's time is learned:
* a call that comes during the hold gives it exactly (`came`: a decaying maximum, up at
  once, down by RETURN_DECAY a return);
* one that misses the hold cannot be timed (predd has one thread: a call that comes
  during a step is handled after it, when its object is no longer expected), so
  `missed` raises its time to RETURN_RAISE times the hold it missed: the hold climbs
  until the programs make it, or passes its cap, and then the object is not waited for
  (math.inf) until a call of it comes within a hold again.
An object not yet timed counts as due at once; the quantile is taken over every
expected object, so one slow object among ten or more cannot hold the others. Entries
live until the object is freed (`forget`).

(On a GPU, steps can be shorter than a program's round trip; holding only a fraction
of a step then splits the programs into two cohorts that alternate, each step half
full: docs/kernels.md, "Holding the next launch for returning programs".)
"""
from __future__ import annotations

import math
from collections.abc import Collection

RETURN_DECAY = 0.8        # a learned time decays by this a return
RETURN_RAISE = 1.25       # ... and is raised to this times a hold it missed
RETURN_QUANTILE = 0.9     # the hold waits until this share of the expected objects are due
RETURN_STEPS = 1.0        # ... if that is within this many step times


class ReturnTimes:
    def __init__(self) -> None:
        self.times: dict[int, float] = {}    # oid -> learned seconds to its next call
        self.hold_s = 0.0                    # the hold after the last step
        self.cap_s = 0.0                     # ... and the most it could have been

    def came(self, oid: int, seconds: float) -> None:
        """An expected object's call came `seconds` after the step's end, within the hold."""
        before = self.times.get(oid, math.inf)
        self.times[oid] = seconds if math.isinf(before) else max(seconds,
                                                                 RETURN_DECAY * before)

    def missed(self, oid: int) -> None:
        """An expected object's call did not come before the next step ended."""
        if self.hold_s >= self.cap_s:
            self.times[oid] = math.inf
        else:
            self.times[oid] = max(self.times.get(oid, 0.0), RETURN_RAISE * self.hold_s)

    def forget(self, oid: int) -> None:
        self.times.pop(oid, None)

    def plan(self, expected: Collection[int], step_time: float, wait_factor: float,
             max_wait_s: float) -> float:
        """The hold for the launch after a step of `step_time` seconds whose `expected`
        objects are to come back (kept as `hold_s`)."""
        self.cap_s = min(RETURN_STEPS * step_time, max_wait_s)
        self.hold_s = min(wait_factor * step_time, self.cap_s)
        if expected:
            due = sorted(self.times.get(o, 0.0) for o in expected)
            last = due[math.ceil(RETURN_QUANTILE * len(due)) - 1]
            if last <= self.cap_s:
                self.hold_s = max(self.hold_s, last)
        return self.hold_s
