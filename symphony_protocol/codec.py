"""The bytes on the wire: a request or reply is one msgpack map, then binary frames."""
from __future__ import annotations

import msgpack

def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_request(op: str, rid: int, fields_: dict) -> bytes:
    return pack({"op": op, "rid": rid, **fields_})
