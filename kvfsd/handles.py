"""One open of a cache file: the descriptor it reads, and what is written through it.

Writes are buffered until flush: only a whole descriptor means something. A write that
cannot be the start of one is refused at once and poisons the handle, so the file is
left as it was: EFBIG when it would end past `descriptor.MAX_LEN` (checked before
anything is allocated, whatever the offset), EINVAL when it does not start like one.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import pyfuse3

from kvfsd.node import Node
from symphony_protocol import descriptor
MAGIC = descriptor.MAGIC.encode()


@dataclass(eq=False)
class Handle:
    fh: int
    node: Node
    flags: int
    uid: int = 0                    # who opened it: objects made for it are charged there
    cap: str | None = None          # this open's grant (readable opens) ...
    replica: str = ""               # ... on this replica (the file's home at open)
    data: bytes = b""               # the descriptor this open reads
    written: bytearray | None = None
    truncate: bool = False          # O_TRUNC: empty the cache at flush, unless written
    backup: str | None = None       # the cache as it was before this open emptied it ...
    backup_replica: str = ""        # ... on this replica
    installed: str | None = None    # the empty cache that open put in its place
    rejected: bool = False          # a non-descriptor was written: ignore the rest

    @property
    def readable(self) -> bool:
        return self.flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)

    @property
    def writable(self) -> bool:
        return self.flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)

    @property
    def pending(self) -> bool:
        return bool(self.written) or self.truncate

    def accept(self, off: int, buf) -> None:
        """Buffer a write; EFBIG past the descriptor limit, EINVAL as soon as it cannot
        be a descriptor."""
        if self.rejected:
            raise pyfuse3.FUSEError(errno.EINVAL)
        have = len(self.written or b"")
        if self.flags & os.O_APPEND:
            off = have
        if off < 0 or off + len(buf) > descriptor.MAX_LEN:
            self._reject(errno.EFBIG)
        w = bytearray(self.written or b"")
        if off > have:
            w.extend(bytes(off - have))
        w[off:off + len(buf)] = buf
        if not MAGIC.startswith(bytes(w[:len(MAGIC)])):
            self._reject(errno.EINVAL)
        self.written = w

    def _reject(self, code: int):
        self.rejected, self.written, self.truncate = True, None, False
        raise pyfuse3.FUSEError(code)

    def take_descriptor(self) -> descriptor.Descriptor:
        """The buffered descriptor (EINVAL if it is not one); the buffer is consumed."""
        data, self.written, self.truncate = bytes(self.written or b""), None, False
        try:
            return descriptor.parse(data)
        except ValueError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None
