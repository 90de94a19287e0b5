"""The step record the runner computes: one `Chunk` per planned call, and how the engine
makes them from a plan.

A chunk is a call's next tokens with their positions, the page table of the KV object
they extend, how many entries they attend to (the object's, the call's earlier tokens
not yet committed, and their own), and which of them want logits. The runner
(predd/worker/runner.py) and tensor-parallel ranks (predd/worker/tp.py) read chunks;
nothing here imports them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from predd.engine.calls import Call
    from predd.engine.scheduler import PlanItem
    from predd.memory.kvstore import KVStore


@dataclass
class Chunk:
    tokens: np.ndarray        # [n] token ids to compute
    positions: np.ndarray     # [n]
    pages: np.ndarray         # the call's page table: ceil(kv_len / page_size) page ids
    kv_len: int               # entries the chunk attends to, its own n last
    outputs: np.ndarray       # indices into the chunk whose logits are wanted


def chunks_for(plan: list[PlanItem], store: KVStore, settled: set[int],
               fail: Callable[[Call, Exception], None]
               ) -> tuple[list[PlanItem], list[Chunk]]:
    """The runner's view of each planned call's chunk, and the items that have one. The
    page tables come from one lookup for the step; a call whose chunk cannot be made
    fails alone (`fail`, and its id into `settled`)."""
    items, parts = [], []
    for item in plan:
        try:
            call = item.call
            tokens, positions, wanted = call.chunk(item.start, item.count)
            obj = store.get(call.oid)
            kv_len = obj.length + item.start + item.count - call.committed
            parts.append((tokens, positions, obj, kv_len, wanted))
            items.append(item)
        except Exception as exc:
            settled.add(item.call.cid)
            fail(item.call, exc)
    try:
        tables = store.page_tables([(obj, kv_len) for _, _, obj, kv_len, _ in parts])
    except Exception:       # one call's table is wrong: find it, the others go on
        tables = []
        for item, (_, _, obj, kv_len, _) in zip(items, parts):
            try:
                tables.append(store.page_tables([(obj, kv_len)])[0])
            except Exception as exc:
                settled.add(item.call.cid)
                fail(item.call, exc)
                tables.append(None)
    chunks = [Chunk(tokens, positions, table, kv_len, wanted) for
              (tokens, positions, _, kv_len, wanted), table in zip(parts, tables)
              if table is not None]
    return [item for item, table in zip(items, tables) if table is not None], chunks
