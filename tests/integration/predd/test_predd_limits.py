"""Bad and greedy input on the real predd: each gets its exact
errno and message, takes no page (pages_free is back to the exact number), leaves fsck
clean (the `lip` fixture), and a well-behaved generate in flight at the same time gets
exactly the tokens it gets alone."""
from __future__ import annotations

import struct
import zlib

import msgpack
import numpy as np
import pytest

from tests.integration.raw_peer import Peer

MAX_POSITION = 2**31 - 1


@pytest.fixture
def peers(predd):
    made: list[Peer] = []

    def make() -> Peer:
        made.append(Peer(predd.addr))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


# ---------------------------------------------------------------- exports, damaged

def unpack_export(blob: bytes) -> tuple[dict, bytes]:
    assert blob.startswith(b"SYKV2\n")
    at = len(b"SYKV2\n")
    (head_len,) = struct.unpack_from("<I", blob, at)
    return msgpack.unpackb(blob[at + 4:at + 4 + head_len]), blob[at + 4 + head_len:-4]


def pack_export(meta: dict, body: bytes) -> bytes:
    head = msgpack.packb(meta)
    out = b"SYKV2\n" + struct.pack("<I", len(head)) + head + body
    return out + struct.pack("<I", zlib.crc32(out))


def damaged_exports(blob: bytes, vocab: int) -> dict[str, tuple[bytes, str]]:
    meta, body = unpack_export(blob)
    n = meta["length"]
    shape = meta["shape"]
    kv = np.frombuffer(body, np.float32).copy()
    nan, inf = kv.copy(), kv.copy()
    nan[len(kv) // 3] = np.nan
    inf[-1] = -np.inf
    wide = [*shape[:4], shape[4] * 2]
    return {
        # ~300 KB, the same count of numbers in another geometry: this leaked its pages.
        "shape": (pack_export({**meta, "shape": wide}, body + body),
                  f"corrupt KV export: shape {wide}, expected {shape}"),
        "token past the vocabulary": (
            pack_export({**meta, "tokens": meta["tokens"][:-1] + [vocab]}, body),
            f"corrupt KV export: tokens: out of range [0, {vocab})"),
        "position past int32": (
            pack_export({**meta, "positions": [MAX_POSITION] * n}, body),
            f"corrupt KV export: positions: out of range [0, {MAX_POSITION})"),
        "NaN K/V": (pack_export(meta, nan.tobytes()), "KV export holds NaN or infinite K/V"),
        "infinite K/V": (pack_export(meta, inf.tobytes()), "KV export holds NaN or infinite K/V"),
        "flipped byte": (blob[:100] + bytes([blob[100] ^ 4]) + blob[101:],
                         "corrupt KV export: checksum mismatch (truncated or damaged)"),
        "truncated": (blob[:-1], "corrupt KV export: checksum mismatch (truncated or damaged)"),
    }


def test_bad_imports_are_einval_and_take_no_page(lip, peers):
    peer = peers()
    info = peer.ok("info")
    cap = peer.ok("kv_create")["cap"]
    peer.ok("pred", cap=cap, tokens=[1, 2, 3, 4, 5, 6], outputs=[])
    blob = peer.send("kv_export", cap=cap)
    head, (blob,) = peer.recv()
    assert head["ok"] and len(blob) > 250_000
    free = peer.ok("stats")["pages_free"]
    for case, (bad, message) in damaged_exports(blob, info["vocab_size"]).items():
        reply = peer.ask("kv_import", bad)
        assert reply["error"] == {"code": "EINVAL", "message": message}, case
        assert peer.ok("stats")["pages_free"] == free, case
    assert peer.ok("kv_import", blob)["tokens"] == 6     # the undamaged one imports
    peer.ok("bye")


# ---------------------------------------------------------------- limits

def test_each_bomb_gets_its_errno_and_takes_no_page(lip, peers):
    peer = peers()
    info = peer.ok("info")
    vocab, context = info["vocab_size"], info["max_position"]
    cap = peer.ok("kv_create")["cap"]
    peer.ok("pred", cap=cap, tokens=list(range(1, 41)), outputs=[])
    high = peer.ok("kv_create")["cap"]
    peer.ok("pred", cap=high, tokens=[1, 2], positions=[MAX_POSITION - 3, MAX_POSITION - 2],
            outputs=[])
    wide = peer.ok("kv_create")["cap"]       # 64 of it are just past the context
    n_wide = context // 64 + 1
    peer.ok("pred", cap=wide, tokens=[7] * n_wide, outputs=[])

    def big(what, n, limit):
        return "E2BIG", f"{what}: {n} is more than the limit of {limit}"

    cases = [
        ("pred", dict(cap=cap, tokens=[1], outputs=[0] * 200_000),
         big("pred.outputs", 200_000, 4096)),
        ("pred", dict(cap=cap, tokens=[1] * (context + 1)),
         big("pred.tokens", context + 1, context)),
        ("pred", dict(cap=cap, tokens=[1], topk=vocab + 1),
         ("EINVAL", "pred.topk must be in [0, 1024]")),
        ("pred", dict(cap=cap, tokens=[1], mask=list(range(vocab)) * 20),
         big("pred.mask", vocab * 20, vocab)),
        ("pred", dict(cap=high, tokens=[3, 4]),
         ("EOVERFLOW", f"positions would reach {MAX_POSITION}: past the largest position "
          f"{MAX_POSITION - 1}")),
        ("generate", dict(cap=cap, tokens=[1], max_tokens=2**62),
         ("EINVAL", f"generate.max_tokens must be in [1, {context}]")),
        ("generate", dict(cap=cap, tokens=[1], stop_text=["x" * 100_000]),
         big("generate.stop_text characters", 100_000, 256)),
        ("generate", dict(cap=cap, tokens=[1], stop_text=["a"] * 1000),
         big("generate.stop_text", 1000, 16)),
        ("kv_merge", dict(caps=[cap] * 10_000), big("kv_merge.caps", 10_000, 64)),
        ("kv_merge", dict(caps=[wide] * 64),
         ("E2BIG", f"kv_merge: the new object would hold {64 * n_wide} entries, more than "
          f"the limit of {context}")),
        ("kv_extract", dict(cap=cap, ranges=[[0, 40]] * 1000),
         ("E2BIG", f"kv_extract: the new object would hold 40000 entries, more than the "
          f"limit of {context}")),
        ("kv_extract", dict(cap=cap, ranges=[[0, 1]] * 5000), big("kv_extract.ranges", 5000, 1024)),
        ("kv_extract", dict(cap=cap, ranges=[[0, 2**40]]),
         ("EINVAL", f"range [0, {2**40}] outside [0, 40]")),
        ("kv_tokens", dict(cap=cap, start=0, end=2**62),
         ("EINVAL", f"range [0, {2**62}) outside 0..40")),
        ("detokenize", dict(tokens=[1] * 300_000), big("detokenize.tokens", 300_000, 2**18)),
        ("tokenize", dict(text="a" * (2**20 + 1)), big("tokenize.text characters", 2**20 + 1,
                                                        2**20)),
    ]
    free = peer.ok("stats")["pages_free"]
    objects = peer.ok("fsck")["objects"]
    for op, fields, expected in cases:
        reply = peer.ask(op, **fields)
        assert (reply["error"]["code"], reply["error"]["message"]) == expected, op
        stats = peer.ok("stats")
        assert (stats["pages_free"], stats["pending_calls"]) == (free, 0), op
        assert peer.ok("fsck")["objects"] == objects
    assert peer.ok("kv_tokens", cap=cap)["tokens"] == list(range(1, 41))
    peer.ok("bye")


# ---------------------------------------------------------------- isolation

@pytest.mark.slow
def test_poison_from_one_client_leaves_a_concurrent_generate_exact(lip, peers):
    """A generate from one client is in flight (its first token streamed) when another
    client sends every poisoned request above; the generate's tokens are exactly its
    solo run's, and the poisoned requests took nothing."""
    prompt = lip.tokenize("Write one sentence about the sea.")
    solo_kv = lip.kv_create()
    solo = list(lip.generate(solo_kv, prompt, max_tokens=24, ignore_eos=True))
    lip.kv_close(solo_kv)

    good, bad = peers(), peers()
    cap = good.ok("kv_create")["cap"]
    free = bad.ok("stats")["pages_free"]
    mine = bad.ok("kv_create")["cap"]
    bad.ok("pred", cap=mine, tokens=[1, 2], positions=[MAX_POSITION - 2, MAX_POSITION - 1],
           outputs=[])
    blob_rid = bad.send("kv_export", cap=mine)
    head, (blob,) = bad.recv()
    assert head["rid"] == blob_rid
    meta, body = unpack_export(blob)
    kv = np.frombuffer(body, np.float32).copy()
    kv[7] = np.nan

    rid = good.send("generate", cap=cap, tokens=prompt, max_tokens=24, stop=[], stream=True)
    first, _ = good.recv()                              # the generate is running now
    assert first["rid"] == rid and first["more"]

    poison = [
        ("kv_import", (pack_export(meta, kv.tobytes()),), {}),
        ("pred", (), dict(cap=mine, tokens=[5])),       # EOVERFLOW at admission, in a step
        ("pred", (), dict(cap=mine, tokens=[5], outputs=[0] * 100_000)),
        ("kv_merge", (), dict(caps=[mine] * 1000)),
        ("generate", (), dict(cap=mine, tokens=[], max_tokens=2**40)),
        ("detokenize", (), dict(tokens=[10**9])),
    ]
    rids = [bad.send(op, *frames, **fields) for op, frames, fields in poison]
    codes = {}
    for _ in rids:
        head, _ = bad.recv()
        codes[head["rid"]] = head["error"]["code"]
    assert [codes[r] for r in rids] == ["EINVAL", "EOVERFLOW", "E2BIG", "E2BIG", "EINVAL",
                                        "EINVAL"]
    got = list(first["tokens"])
    while True:
        head, _ = good.recv()
        assert head["rid"] == rid and head["ok"], head
        got += head["tokens"]
        if not head["more"]:
            break
    assert got == solo
    # One terminal message, with the outcome: the next message is the next reply.
    assert head["finish_reason"] == "length" and head["generated"] == 24
    assert good.ask("ping")["ok"]
    bad.ok("kv_free", cap=mine)
    assert bad.ok("stats")["pages_free"] == free - (len(prompt) + 23 + 15) // 16
    good.ok("bye")
    bad.ok("bye")


# ---------------------------------------------------------------- stop strings

@pytest.mark.slow
def test_stop_text_stops_at_the_first_token_whose_text_holds_it(lip):
    prompt = lip.tokenize("List the days of the week, separated by commas:")
    kv = lip.kv_create()
    free = list(lip.generate(kv, prompt, max_tokens=40, ignore_eos=True))
    lip.kv_close(kv)
    text = lip.detokenize(free)
    target = text[len(text) * 2 // 3:len(text) * 2 // 3 + 3]
    expect = next(k for k in range(1, 41) if target in lip.detokenize(free[:k]))
    kv = lip.kv_create()
    out = lip.generate(kv, prompt, max_tokens=40, stop=[target], ignore_eos=True)
    assert out.finish_reason == "stop" and list(out) == free[:expect]
    lip.kv_close(kv)
