"""Fixtures shared by the integration tests (pytest finds them here; no module imports
them): a kvfsd mount over the shared predd, and the reference, transformers' model
loaded from the same GGUF file predd serves (once per test session; ~15 s)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.integration.kvfs_fixtures import finish, start_kvfsd


@pytest.fixture
def kvfs(predd, lip, tmp_path, monkeypatch):
    """kvfsd on a fresh mount over the shared predd; $KVFS_MOUNT points at it."""
    k = start_kvfsd(predd.addr, str(tmp_path / "state"))
    monkeypatch.setenv("KVFS_MOUNT", k.mount)
    try:
        yield k
    finally:
        code = finish(k)
    assert code == 0, f"kvfsd exited {code}: {k.log_text()[-2000:]}"


@pytest.fixture(scope="session")
def gguf_path() -> str:
    from predd.model.loader import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(gguf_path)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32)
    return model.eval()
