"""The bytes on the wire: a request or reply is one msgpack map, then binary frames."""
from __future__ import annotations

import msgpack

# one packer for every message (packb makes one a call); its pack runs under the GIL
# without calling back into Python, so threads cannot interleave in it
_PACKER = msgpack.Packer(use_bin_type=True)


def pack(obj: dict) -> bytes:
    return _PACKER.pack(obj)


def encode_request(op: str, rid: int, fields_: dict) -> bytes:
    return pack({"op": op, "rid": rid, **fields_})
