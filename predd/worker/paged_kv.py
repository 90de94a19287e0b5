"""The paged KV tensor: one preallocated pool per device.

Layout (FlashInfer's NHD paged layout, shared by every attention backend):
`kv[layer]` is `[num_pages, 2, page_size, num_kv_heads, head_dim]`, index 0 of dim 1
holding K and 1 holding V. A flat slot id `s` (page `s // page_size`, slot
`s % page_size`) has its K at row `rows(s)` of `kv[layer].view(-1, Hkv, D)` and its V
`page_size` rows later. This class is the KV store's `PageData`.

`spare_pages` are pages past `num_pages` that the store never hands out (CUDA graphs'
padding rows write and read one: predd/worker/cuda_graphs.py).
"""
from __future__ import annotations

import numpy as np
import torch

from predd.memory import huge_pages
from predd.model.loader import ModelConfig


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, spare_pages: int = 0) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        self.spare_pages = spare_pages
        self.dtype = dtype
        self.device = device
        shape = (cfg.num_layers, num_pages + spare_pages, 2, page_size, cfg.num_kv_heads,
                 cfg.head_dim)
        self.kv = (huge_pages.zeros(shape, dtype) if torch.device(device).type == "cpu"
                   else torch.zeros(shape, dtype=dtype, device=device))

    @property
    def bytes_per_page(self) -> int:
        return self.kv[0, 0].numel() * self.kv.element_size() * self.cfg.num_layers

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """K rows of flat slot ids in `flat(layer)`; V rows are `+ page_size`."""
        ps = self.page_size
        slots = np.asarray(slots, dtype=np.int64)
        return (slots // ps) * (2 * ps) + slots % ps

    def flat(self, layer: int) -> torch.Tensor:
        return self.kv[layer].view(-1, self.cfg.num_kv_heads, self.cfg.head_dim)

    def _all_rows(self, slots: np.ndarray) -> torch.Tensor:
        k = self.rows(slots)
        return torch.from_numpy(np.concatenate([k, k + self.page_size])).to(self.device)

    # ------------------------------------------------------------ PageData

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src) == 0:
            return
        s, d = self._all_rows(src), self._all_rows(dst)
        view = self.kv.view(self.cfg.num_layers, -1, self.cfg.num_kv_heads, self.cfg.head_dim)
        view[:, d] = view[:, s]

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        """[layers, 2, n, Hkv, D] as numpy (bf16 travels as its raw uint16 bits)."""
        n = len(slots)
        rows = self._all_rows(slots)
        view = self.kv.view(self.cfg.num_layers, -1, self.cfg.num_kv_heads, self.cfg.head_dim)
        data = view[:, rows].reshape(self.cfg.num_layers, 2, n, self.cfg.num_kv_heads,
                                     self.cfg.head_dim).cpu()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.uint16)
        return data.numpy()

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        n = len(slots)
        tensor = torch.from_numpy(np.ascontiguousarray(data))
        if self.dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        tensor = tensor.to(self.device).reshape(self.cfg.num_layers, 2 * n,
                                                self.cfg.num_kv_heads, self.cfg.head_dim)
        view = self.kv.view(self.cfg.num_layers, -1, self.cfg.num_kv_heads, self.cfg.head_dim)
        view[:, self._all_rows(slots)] = tensor

    def describe(self) -> dict:
        numpy_dtype = "uint16" if self.dtype == torch.bfloat16 else str(self.dtype).split(".")[1]
        return {"model": self.cfg.name, "dtype": str(self.dtype).split(".")[1],
                "numpy_dtype": numpy_dtype, "layers": self.cfg.num_layers,
                "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim}
