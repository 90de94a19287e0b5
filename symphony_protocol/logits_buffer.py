"""A logits buffer's layout, which a client and predd must agree on (docs/protocol.md):
a memfd the client creates and seals against resizing (`SEALS`, which predd requires),
of slots of `slot_bytes(vocab)` each, one row of float32 logits a slot."""
from __future__ import annotations

import fcntl

PAGE = 4096
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL   # what predd requires


def slot_bytes(vocab: int) -> int:
    """One row of float32 logits, rounded up to whole pages (predd's stride too)."""
    return -(-vocab * 4 // PAGE) * PAGE
