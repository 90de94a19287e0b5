"""The client's half of a logits buffer (predd/logits_buffer.py is predd's): a tmpfs file
this process creates and maps read-only, whose descriptor `hello` names. predd writes a
raw `pred`'s one row into the slot the request names (`into`) instead of sending it as a
196 KB frame; the call copies it out and gives the slot back.

A slot whose reply never came (a timeout, a lost predd, an interrupt) is retired, not
reused: predd may still write it, and a later call must not read that row as its own.
With every slot taken or retired, a call gets its row as a frame, as without a buffer.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np

SLOTS = 64
TMPFS_MAGIC = 0x01021994
_libc = ctypes.CDLL(None, use_errno=True)


class LogitsBuffer:
    def __init__(self, fd: int, slots: int) -> None:
        self.fd, self.slots = fd, slots
        self._rows: np.ndarray | None = None      # [slots, slot floats], once mapped
        self._free = list(range(slots - 1, -1, -1))   # the lowest slot first: fewer pages
        self._lock = threading.Lock()

    @classmethod
    def create(cls, slots: int = SLOTS) -> LogitsBuffer | None:
        """An empty tmpfs file for predd to size, or None where none can be made (a
        sandbox refuses memfd_create; its $TMPDIR is its own tmpfs)."""
        try:
            return cls(os.memfd_create("liblip-logits", os.MFD_CLOEXEC), slots)
        except (OSError, AttributeError):
            pass
        tmpfile = getattr(os, "O_TMPFILE", 0)         # Linux only, as is predd's half
        for folder in (os.environ.get("TMPDIR", ""), "/dev/shm", "/tmp"):
            if not folder or not tmpfile:
                continue
            try:
                fd = os.open(folder, tmpfile | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError:
                continue
            if _on_tmpfs(fd):
                return cls(fd, slots)
            os.close(fd)
        return None

    def map(self, slot_bytes: int) -> None:
        """Map the file predd sized (`slots` rows of `slot_bytes`), read-only; the
        descriptor is no longer needed (predd holds its own)."""
        try:
            view = mmap.mmap(self.fd, self.slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            self.close()
        self._rows = np.frombuffer(view, dtype=np.float32).reshape(self.slots, slot_bytes // 4)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @contextlib.contextmanager
    def slot(self) -> Iterator[int]:
        """A free slot for one call (-1: none, the row comes as a frame); given back
        when the call returns or raises an error predd replied with, retired otherwise."""
        with self._lock:
            slot = self._free.pop() if self._free and self._rows is not None else -1
        replied = False
        try:
            yield slot
            replied = True
        except Exception as exc:
            replied = getattr(exc, "from_predd", False)
            raise
        finally:
            if slot >= 0 and replied:
                with self._lock:
                    self._free.append(slot)

    def row(self, slot: int, vocab: int) -> np.ndarray:
        """A copy of the row predd put in `slot` (the slot is reused by later calls)."""
        assert self._rows is not None
        return self._rows[slot, :vocab].copy()


def _on_tmpfs(fd: int) -> bool:
    buf = ctypes.create_string_buffer(120)    # struct statfs; f_type is its first long
    return (_libc.fstatfs(fd, buf) == 0
            and ctypes.c_long.from_buffer(buf).value == TMPFS_MAGIC)
