"""What predd counts for `stats` and /metrics: totals since start and two histograms
(queue wait per admitted call, time per forward pass)."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

HIST_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)   # bucket bounds


@dataclass
class Histogram:
    """Counts per bucket (upper bounds HIST_MS, then +inf) and the sum, in ms."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(HIST_MS) + 1))
    sum_ms: float = 0.0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(HIST_MS, ms)] += 1
        self.sum_ms += ms

    def wire(self) -> dict:
        """Cumulative counts per upper bound, as Prometheus histograms are read."""
        return {"le_ms": list(HIST_MS), "cumulative": list(itertools.accumulate(self.counts)),
                "sum_ms": round(self.sum_ms, 3)}


@dataclass
class Counters:
    steps: int = 0
    calls: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0
    queue_wait_s: float = 0.0
    step_s: float = 0.0
    requests: int = 0
    errors: int = 0
    throttled: int = 0        # EAGAIN replies (rate, calls in flight, sessions)
    admission_waits: int = 0  # calls that waited for room on the device
    batch_picks_failed: int = 0   # a step's batched token picks that raised (outputs.py)
    answered_in_flight: int = 0   # requests answered while a step's pass ran (Intake)
    # raw pred rows by the way they went back: the session's logits buffer or a frame
    logits_rows: dict[str, int] = field(default_factory=lambda: {"buffer": 0, "frame": 0})
    # where predd's time goes (seconds): the model's forward passes and the rest; the
    # turns that answer messages while a pass runs on the device (`in_flight`: within
    # `forward`, not beside it); and the CPU of predd's thread handling messages
    # (`requests` is their wall time, which counts a reply's send while the woken program
    # has the core) and in a step outside its forward pass (`step_cpu`: schedule, prepare
    # and outputs)
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("schedule", "prepare", "forward", "outputs", "requests", "in_flight",
         "requests_cpu", "step_cpu"), 0.0))
    queue_hist: Histogram = field(default_factory=Histogram)   # per admitted call
    step_hist: Histogram = field(default_factory=Histogram)    # per forward pass

    def count_step(self, counts: list[int], elapsed: float) -> None:
        """One forward pass that computed `counts` tokens for each of its calls."""
        self.steps += 1
        self.calls += len(counts)
        self.tokens_computed += sum(counts)
        self.step_s += elapsed
        self.step_hist.observe(elapsed * 1e3)
