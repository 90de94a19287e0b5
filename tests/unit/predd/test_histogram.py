"""predd's latency histograms (stats -> /metrics): exact bucket counts."""
from predd.engine.metrics import HIST_MS, Histogram


def test_observations_land_in_the_first_bucket_whose_bound_holds_them():
    h = Histogram()
    for ms in (0.2, 1.0, 1.5, 100.0, 100.1, 99999.0):
        h.observe(ms)
    wire = h.wire()
    assert wire["le_ms"] == list(HIST_MS)
    # <=1: 0.2, 1.0 | <=2: 1.5 | <=100: 100.0 | <=250: 100.1 | +inf: 99999
    assert wire["cumulative"][:2] == [2, 3]
    assert wire["cumulative"][HIST_MS.index(100)] == 4
    assert wire["cumulative"][HIST_MS.index(250)] == 5
    assert wire["cumulative"][-2] == 5 and wire["cumulative"][-1] == 6
    assert wire["sum_ms"] == round(0.2 + 1.0 + 1.5 + 100.0 + 100.1 + 99999.0, 3)
