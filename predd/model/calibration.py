"""Start-up measurements kept per machine, so that every start of predd there makes the
same choices, and so computes the same bits.

predd measures at start-up up to how many rows each kind of projection computes from its
blocks before the dense weight wins (`predd.model.quant_linear.calibrate`). Measured anew at
every start, two starts could choose differently near a limit and sum a row in another
order: a KV cache restored after a restart would then give other logits (~1e-5). So the
first start measures and stores the result in `$SYMPHONY_CACHE/calibration/` (default
`~/.cache/symphony`), under a key of everything the timings depend on (`machine()`: the
CPU's model and flags, the kernel library, torch's version and thread count; the caller
adds the dtype and the projections' shapes and kinds), and later starts read it. Where
the directory cannot be written, or is not this user's alone, the measurement is made at
each start and the start-up line says why. Delete the directory to measure again.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from predd.kernels import build, cpu_kernels


def directory() -> Path:
    return build.cache_dir().parent / "calibration"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a timing on this machine depends on, besides the model."""
    return {"cpu": cpu_model(), "flags": sorted(build.cpu_flags().split(":", 1)[-1].split()),
            "kernels": cpu_kernels.kernels().path.name, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def key_of(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def load(key: str) -> tuple[dict | None, str]:
    """(the record stored under `key`, or None; why not where it cannot be used)."""
    where = directory()
    path = where / f"{key}.json"
    try:
        if not build.owned_alone(where):
            return None, f"{where} is not this user's alone"
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"
    return (record, "") if isinstance(record, dict) else (None, f"{path} is not a record")


def store(key: str, record: dict) -> tuple[dict, str]:
    """Stores `record` under `key` unless a record is there already (two predds measuring
    at once: the first stored wins, and both use it); (the record in force, its path or
    why it was not stored)."""
    where = directory()
    target = where / f"{key}.json"
    record = {**record, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not build.owned_alone(where):
            return record, f"not stored: {where} is not this user's alone"
        fd, partial = tempfile.mkstemp(suffix=".json", dir=where)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            _place(partial, target)          # whole, and never over another's
        except FileExistsError:
            stored, problem = load(key)
            if stored is not None:
                return stored, str(target)
            return record, f"not stored: {target} is there and {problem or 'unreadable'}"
        finally:
            os.unlink(partial)
    except OSError as exc:
        return record, f"not stored: {where}: {exc.strerror}"
    return record, str(target)


def _place(partial: str, target: Path) -> None:
    """`partial` (written whole) also at `target`; FileExistsError where one is there.
    A hard link where the file system has them, else a copy made with O_EXCL."""
    try:
        os.link(partial, target)
    except FileExistsError:
        raise
    except OSError:
        with open(partial, "rb") as src, open(target, "xb") as dst:
            dst.write(src.read())
