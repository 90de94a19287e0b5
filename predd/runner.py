"""The runner: the model, the paged KV tensor and the attention backend.

`execute(chunks)` runs one forward pass over the chunks of a step (one per call) and
returns the float32 logits each chunk asked for. It knows nothing of sessions or
objects: the engine hands it, per call, token ids, positions and a page table (the
pages that hold the call's entries, in order) with the number of entries it attends
to; the step's tables go to the attention backend as one `PageTables`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from predd import linear
from predd.attention import make_backend
from predd.paged_kv import PagedKVCache
from predd.dtype import DTYPES
from predd.loader import ModelConfig, load_weights
from predd.model import LlamaModel
from predd.page_table import PageTables



@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"    # resolved: predd.dtype turns `auto` into one of DTYPES
    dtype_reason: str = ""
    kv_pages: int = 4096
    page_size: int = 16
    attention: str = "torch"  # a predd.attention.CHOICES name; `auto` is resolved at start
    threads: int = 0          # torch intra-op threads on CPU; 0 keeps torch's default
    linear: str = "auto"      # a LINEAR_CHOICES name: packed where the probe passes


LINEAR_CHOICES = ("auto", "plain", "packed")


@dataclass
class Chunk:
    tokens: np.ndarray        # [n] token ids to compute
    positions: np.ndarray     # [n]
    pages: np.ndarray         # the call's page table: ceil(kv_len / page_size) page ids
    kv_len: int               # entries the chunk attends to, its own n last
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
        self.linear, linear_reason = self._pack(config.linear)
        self.cache = PagedKVCache(self.model_config, config.kv_pages, config.page_size,
                                  self.dtype, self.device)
        self.backend = make_backend(config.attention, self.cache)
        progress(f"model {self.model_config.name} ready on {config.device} ({config.dtype}: "
                 f"{config.dtype_reason or 'asked for'}; attention {self.backend.name}; "
                 f"linear {self.linear}: {linear_reason}) "
                 f"in {time.monotonic() - started:.1f}s; KV pool {config.kv_pages} pages "
                 f"x {config.page_size} = {self.cache.kv.numel() * self.cache.kv.element_size() / 2**20:.0f} MiB")

    def _pack(self, requested: str) -> tuple[str, str]:
        """(`packed` or `plain`, why) for `--linear requested`; packs the model's
        projections (predd/linear.py) where chosen. ValueError (EINVAL) when `packed`
        is asked for and cannot run here."""
        if requested not in LINEAR_CHOICES:
            raise ValueError(f"--linear must be one of {', '.join(LINEAR_CHOICES)}, "
                             f"not {requested!r} (EINVAL)")
        if requested == "plain":
            return "plain", "asked for"
        problem = linear.packing_problem(self.device, self.dtype)
        if problem:
            if requested == "packed":
                raise ValueError(f"--linear packed: {problem} (EINVAL)")
            return "plain", f"auto: {problem}"
        count = linear.pack_linears(self.model)
        return "packed", f"{'asked for' if requested == 'packed' else 'auto'}: " \
                         f"{count} projections packed for oneDNN"

    def execute(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """One forward pass; per chunk a [len(outputs), vocab] float32 tensor (CPU)."""
        tables = PageTables.build(self.config.page_size, [c.pages for c in chunks],
                                  [c.kv_len for c in chunks], [len(c.tokens) for c in chunks])
        out_rows = [c.outputs + start for c, start in zip(chunks, tables.qo_indptr)]
        dev = self.device
        input_ids = torch.from_numpy(np.concatenate([c.tokens for c in chunks]).astype(np.int64)).to(dev)
        positions = torch.from_numpy(np.concatenate([c.positions for c in chunks]).astype(np.int64)).to(dev)
        rows = torch.from_numpy(np.concatenate(out_rows).astype(np.int64)).to(dev)
        logits = self.model(input_ids, positions, self.backend.prepare(tables), rows).cpu()
        result, at = [], 0
        for chunk in chunks:
            k = len(chunk.outputs)
            result.append(logits[at:at + k])
            at += k
        return result
