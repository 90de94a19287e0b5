"""The benchmarks and tools, each run as `python scripts/NAME.py`. A package so that
tests import them (`from scripts import bench_agent`) and they import each other as
`scripts.NAME`: one module object whichever way a script was started."""
