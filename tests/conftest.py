"""Shared fixtures: a real predd (real model) per test session, and an integrity check
(`fsck`) after every test that used it."""
from __future__ import annotations

import os

import pytest

from predd.server import launch
from predd.server.launch import Daemon

ROOT = launch.ROOT


def start_predd(rundir: str, *args: str, env: dict | None = None,
                timeout: float = 120.0) -> Daemon:
    """A serving predd (`predd.server.launch.start`), float32 unless the caller names a dtype:
    tests compare with transformers' float32 logits and tokens."""
    if "--dtype" not in args:
        args = ("--dtype", "float32", *args)
    return launch.start(rundir, *args, env=env, timeout=timeout)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: without it they are skipped, saying so."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch
    if not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (marked gpu)"))


PREDD_ARGS = ("--kv-pages", "1024", "--host-pages", "128", "--max-step-tokens", "256",
              "--lease", "3")


@pytest.fixture(scope="session")
def predd(tmp_path_factory):
    """One real predd (SmolLM2-135M, fp32, CPU) shared by the integration tests."""
    daemon = start_predd(str(tmp_path_factory.mktemp("predd")), *PREDD_ARGS)
    os.environ["PREDD_ADDR"] = daemon.addr
    yield daemon
    code = daemon.stop()
    assert code == 0, f"predd exited {code}"


@pytest.fixture
def lip(predd):
    """liblip connected to the shared predd; fsck must be clean after the test."""
    import liblip
    liblip.connect(predd.addr)
    yield liblip
    report = liblip.fsck()
    assert report["clean"], report["problems"]
