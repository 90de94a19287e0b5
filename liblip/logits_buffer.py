"""The client's half of a logits buffer (predd/server/logits_buffer.py is predd's): a memfd this
process creates, sizes to `slots` rows of `slot_bytes`, allocates in full (its pages are
this process's memory: predd's writes allocate none), seals against resizing and maps
read-only; `hello` names its descriptor. predd writes a raw `pred`'s one row into the
slot the request names (`into`) instead of sending it as a 196 KB frame; the call copies
it out and gives the slot back.

A slot whose reply never came (a timeout, a lost predd, an interrupt) is retired, not
reused: predd may still write it, and a later call must not read that row as its own.
With every slot taken or retired, a call gets its row as a frame, as without a buffer.
Where memfd_create is refused (the sandbox's seccomp filter), there is no buffer.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading

import numpy as np

from symphony_protocol.logits_buffer import SEALS, slot_bytes

SLOTS = 16          # rows in flight through the buffer: 3 MiB here (SmolLM2), 8 at 128K
MOST_SLOTS = 64     # a threaded program's, once 16 were not enough (predd's most)

class LogitsBuffer:
    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.fd, self.slots, self.slot_bytes = fd, slots, slot_bytes
        self._view = mmap.mmap(fd, slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self._rows: np.ndarray | None = np.frombuffer(self._view, dtype=np.float32).reshape(
            slots, slot_bytes // 4)
        self._free = list(range(slots - 1, -1, -1))   # the lowest slot first: fewer pages
        self._lock = threading.Lock()

    @classmethod
    def create(cls, vocab: int, slots: int = SLOTS) -> LogitsBuffer | None:
        """A sealed memfd of `slots` rows of `vocab` float32 logits (each rounded up to
        a page), mapped; None where one cannot be made."""
        stride = slot_bytes(vocab)
        try:
            fd = os.memfd_create("liblip-logits", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (OSError, AttributeError):
            return None
        try:
            os.ftruncate(fd, slots * stride)
            os.posix_fallocate(fd, 0, slots * stride)   # this process's memory, not predd's
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, slots, stride)
        except OSError:
            os.close(fd)
            return None

    def close_fd(self) -> None:
        """predd holds its own duplicate now (or refused it): the mapping stays (with
        its own descriptor)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.close_fd()
        with self._lock:
            self._free = []
            if self._rows is not None:
                self._rows = None
                self._view.close()

    def slot(self) -> _Slot:
        """A free slot for one call, as a context (-1: none, the row comes as a frame);
        given back when the call returns or raises an error predd replied with, retired
        otherwise."""
        with self._lock:
            return _Slot(self, self._free.pop() if self._free else -1)

    def _give_back(self, slot: int) -> None:
        with self._lock:
            if self._rows is not None:
                self._free.append(slot)

    def row(self, slot: int, vocab: int) -> np.ndarray:
        """A copy of the row predd put in `slot` (the slot is reused by later calls)."""
        with self._lock:
            if self._rows is None:
                raise OSError("the logits buffer is closed")
            return self._rows[slot, :vocab].copy()


class _Slot:
    """`LogitsBuffer.slot()`'s context: a class, not a generator context manager (a
    pred loop enters one a call; this costs a few microseconds less)."""
    __slots__ = ("buffer", "slot")

    def __init__(self, buffer: LogitsBuffer, slot: int) -> None:
        self.buffer, self.slot = buffer, slot

    def __enter__(self) -> int:
        return self.slot

    def __exit__(self, kind, exc, tb) -> None:
        if self.slot >= 0 and (exc is None or getattr(exc, "from_predd", False)):
            self.buffer._give_back(self.slot)
