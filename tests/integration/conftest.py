"""Reference fixtures shared by the integration tests: transformers' model loaded from
the same GGUF file predd serves (loaded once per test session; ~15 s)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(scope="session")
def gguf_path() -> str:
    from predd.loader import default_model_path
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
