"""Other processes' share of predd's CPUs while it measures, from /proc/stat."""
import os

import pytest

from predd.model import calibration

TICK = os.sysconf("SC_CLK_TCK")
# cpu user nice system idle iowait irq softirq steal guest guest_nice
STAT = """cpu  900 0 300 5000 70 0 10 40 0 0
cpu0 500 0 100 2000 50 0 5 20 0 0
cpu1 400 0 200 3000 20 0 5 20 0 0
intr 1 2 3
"""


def test_busy_time_is_everything_but_idle_and_io_wait_of_the_cpus_named():
    assert calibration.busy_seconds(STAT, {0}) == 625 / TICK
    assert calibration.busy_seconds(STAT, {0, 1}) == (625 + 625) / TICK
    assert calibration.busy_seconds(STAT, {1}) == 625 / TICK
    assert calibration.busy_seconds(STAT, {0, 2}) is None       # cpu2 has no line
    assert calibration.busy_seconds("", {0}) is None


def _stat(busy0: int, busy1: int) -> str:
    return f"cpu0 {busy0} 0 0 1000 0 0 0 0 0 0\ncpu1 {busy1} 0 0 1000 0 0 0 0 0 0\n"


def test_others_share_is_the_cpus_busy_time_less_this_process_s(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(_stat(0, 0))
    clock = {"wall": 100.0, "own": 5.0}
    monkeypatch.setattr(calibration.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(calibration.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(calibration.os, "sched_getaffinity", lambda pid: {0, 1})
    c = calibration.Contention(str(stat))
    # 2 s of wall on 2 CPUs: 4 CPU-seconds; they were busy 3 s, 1 s of it this process's
    clock.update(wall=102.0, own=6.0)
    stat.write_text(_stat(2 * TICK, TICK))
    assert c.share() == pytest.approx(0.5)
    stat.write_text(_stat(TICK // 2, 0))        # busy less than this process: none
    assert c.share() == 0.0
    stat.write_text("")
    assert c.share() is None
    assert calibration.Contention(str(tmp_path / "none")).share() is None


def test_a_record_measured_beside_others_work_says_so():
    assert calibration.contended(None) == ""
    assert calibration.contended(calibration.LOADED) == ""
    assert calibration.contended("0.9") == ""
    assert calibration.contended(0.45).startswith("other processes had 45% of the CPUs")
    assert "delete the record" in calibration.contended(0.45)
    assert calibration.contended(0.45, stored=False) == \
        "other processes had 45% of the CPUs while it was measured"   # nothing to delete
