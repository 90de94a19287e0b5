"""B4's split of predd's time: the CPU entries of `time_ms` are within its parts' wall
time, and `in_flight` within the forward's, so the non-model share does not count them
again."""
from scripts.bench_overhead import split_of

ZERO = {"time_ms": dict.fromkeys(("schedule", "prepare", "forward", "outputs", "requests",
                                  "in_flight", "requests_cpu", "step_cpu"), 0.0),
        "steps": 10, "launch_wait_ms": 5.0}


def test_non_model_share_is_the_wall_parts_beside_the_forward():
    after = {"time_ms": {"schedule": 14.0, "prepare": 11.0, "forward": 2794.0,
                         "outputs": 110.0, "requests": 104.0, "in_flight": 50.0,
                         "requests_cpu": 31.0, "step_cpu": 126.0},
             "steps": 110, "launch_wait_ms": 25.0}
    got = split_of(ZERO, after, wall=4.0)
    assert got["steps"] == 100
    assert got["non_model"] == round(239 / 3033, 4)
    assert got["busy_share_of_wall"] == round(3.033 / 4.0, 3)
    assert got["launch_wait_ms_per_step"] == 0.2
    assert got["per_step_ms"]["step_cpu"] == 1.26
