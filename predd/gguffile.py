"""One parsed GGUF file per path, shared by the loader (tensors) and the tokenizer
(vocabulary): parsing the 49k-entry vocabulary and merge list takes seconds, so
predd's start-up does it once. The reader memory-maps the file, read-only."""
from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def reader(path: str) -> Any:
    import gguf
    return gguf.GGUFReader(path)
