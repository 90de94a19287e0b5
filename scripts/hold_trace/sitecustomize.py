"""A measuring hook for predd's adaptive-launch hold (docs/kernels.md, "Holding
the next launch for returning programs"), loaded by putting this folder on PYTHONPATH: with HOLD_TRACE=FILE,
every predd started with that environment appends to FILE at exit the percentiles of the
return times of calls that came within a hold, its holds, its step times and its
expected objects per step; HOLD_STEPS=N sets predd.engine.return_times.RETURN_STEPS and
HOLD_QUANTILE=Q its RETURN_QUANTILE. Other processes only get a path hook.

    PYTHONPATH=$PWD:$PWD/scripts/hold_trace HOLD_TRACE=/tmp/hold.txt \
        python3 scripts/bench_completion.py --programs 64 --modes pred_sample ...
"""
import atexit
import os
import sys

if os.environ.get("HOLD_TRACE"):
    import importlib.abc
    import importlib.util

    def patch(m):
        if os.environ.get("HOLD_STEPS"):
            m.RETURN_STEPS = float(os.environ["HOLD_STEPS"])
        if os.environ.get("HOLD_QUANTILE"):
            m.RETURN_QUANTILE = float(os.environ["HOLD_QUANTILE"])
        R = m.ReturnTimes
        samples, holds, steps, expected = [], [], [], []
        came, plan = R.came, R.plan

        def _came(self, oid, seconds):
            samples.append(seconds)
            return came(self, oid, seconds)

        def _plan(self, exp, step_time, wait_factor, max_wait_s):
            hold = plan(self, exp, step_time, wait_factor, max_wait_s)
            holds.append(hold)
            steps.append(step_time)
            expected.append(len(exp))
            return hold

        R.came, R.plan = _came, _plan

        def dump():
            def pct(xs):
                xs = sorted(x for x in xs if x != float("inf"))
                if not xs:
                    return "-"
                return " ".join(f"p{q}={xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3:.2f}"
                                for q in (10, 50, 90, 99))
            with open(os.environ["HOLD_TRACE"], "a") as f:
                f.write(f"RETURN_STEPS={m.RETURN_STEPS} RETURN_QUANTILE={m.RETURN_QUANTILE} "
                        f"steps={len(steps)}\n"
                        f"  returns ms ({len(samples)}): {pct(samples)}\n"
                        f"  holds ms: {pct(holds)}\n  step ms: {pct(steps)}\n"
                        f"  expected: {pct([e / 1e3 for e in expected])} (x1000)\n")
        atexit.register(dump)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "predd.engine.return_times":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, Finder())
