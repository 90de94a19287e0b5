"""The runner: the model, the paged KV tensor and the attention backend.

`execute(chunks)` runs one forward pass over the chunks of a step (one per call) and
returns the float32 logits each chunk asked for. It knows nothing of sessions or
objects: the engine hands it token ids, positions and slot ids.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from predd.attention import SeqLayout, make_backend
from predd.cache import PagedKVCache
from predd.dtype import DTYPES
from predd.loader import ModelConfig, load_weights
from predd.model import LlamaModel



@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"    # resolved: predd.dtype turns `auto` into one of DTYPES
    dtype_reason: str = ""
    kv_pages: int = 4096
    page_size: int = 16
    attention: str = "torch"
    threads: int = 0          # torch intra-op threads on CPU; 0 keeps torch's default


@dataclass
class Chunk:
    tokens: np.ndarray        # [n] token ids to compute
    positions: np.ndarray     # [n]
    ctx_slots: np.ndarray     # [L] every entry this chunk attends to, its own n last
    outputs: np.ndarray       # indices into the chunk whose logits are wanted


class Runner:
    def __init__(self, config: RunnerConfig,
                 progress: Callable[[str], None] = lambda msg: None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        if config.threads:
            torch.set_num_threads(config.threads)
        started = time.monotonic()
        self.model_config, weights = load_weights(config.model_path, self.dtype, progress)
        self.model = LlamaModel(self.model_config).to(self.dtype)
        self.model.load(weights)
        self.model.to(self.device).eval()
        self.model.inv_freq = self.model.inv_freq.float()
        del weights
        self.cache = PagedKVCache(self.model_config, config.kv_pages, config.page_size,
                                  self.dtype, self.device)
        self.backend = make_backend(config.attention, self.cache)
        progress(f"model {self.model_config.name} ready on {config.device} ({config.dtype}: "
                 f"{config.dtype_reason or 'asked for'}) "
                 f"in {time.monotonic() - started:.1f}s; KV pool {config.kv_pages} pages "
                 f"x {config.page_size} = {self.cache.kv.numel() * self.cache.kv.element_size() / 2**20:.0f} MiB")

    @property
    def cfg(self) -> ModelConfig:
        return self.model_config

    def execute(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """One forward pass; per chunk a [len(outputs), vocab] float32 tensor (CPU)."""
        seqs, out_rows, start = [], [], 0
        for chunk in chunks:
            n = len(chunk.tokens)
            seqs.append(SeqLayout(start, n, chunk.ctx_slots))
            out_rows.append(chunk.outputs + start)
            start += n
        dev = self.device
        input_ids = torch.from_numpy(np.concatenate([c.tokens for c in chunks]).astype(np.int64)).to(dev)
        positions = torch.from_numpy(np.concatenate([c.positions for c in chunks]).astype(np.int64)).to(dev)
        rows = torch.from_numpy(np.concatenate(out_rows).astype(np.int64)).to(dev)
        logits = self.model(input_ids, positions, self.backend.prepare(seqs), rows).cpu()
        result, at = [], 0
        for chunk in chunks:
            k = len(chunk.outputs)
            result.append(logits[at:at + k])
            at += k
        return result
