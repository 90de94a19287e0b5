"""KV objects on the real model: fork is copy-on-write and exact, extract and merge keep
exactly the entries asked for, export/import round-trips bit-exactly, and the public
cost figures prove reuse."""
from __future__ import annotations

import numpy as np
import pytest


def pages_used(lip) -> int:
    s = lip.stats()
    return s["pages_total"] - s["pages_free"]


@pytest.mark.slow
def test_fork_is_copy_on_write_and_exact(lip):
    start = pages_used(lip)
    prefix = lip.tokenize("In a paged KV cache, a fork shares every page. " * 90)[:1000]
    assert len(prefix) == 1000
    suffix = lip.tokenize(" The suffix makes the fork diverge.")
    kv = lip.kv_create()
    lip.prefill(kv, prefix)
    assert lip.kv_stat(kv)["pages"] == 63   # ceil(1000 / 16)

    before = pages_used(lip)
    fork = lip.kv_fork(kv)
    assert pages_used(lip) - before == 0                    # fork itself: no page
    dist = lip.pred(fork, suffix)
    # the partial last page is copied, plus what the suffix needs beyond it
    new_pages = pages_used(lip) - before
    assert new_pages == 1 + (1000 % 16 + len(suffix) - 1) // 16
    assert dist.cost["computed"] == len(suffix) and dist.cost["reused"] == 1000

    whole = lip.kv_create()
    ref = lip.pred(whole, prefix + suffix)
    assert np.abs(dist.logits - ref.logits).max() <= 1e-4
    assert dist.argmax() == ref.argmax()
    # the original is untouched by the fork's writes
    assert lip.kv_tokens(kv) == prefix
    assert lip.kv_tokens(fork) == prefix + suffix
    for h in (kv, fork, whole):
        lip.kv_close(h)
    assert pages_used(lip) == start


def test_fork_of_aligned_object_allocates_one_page_on_append(lip):
    kv = lip.kv_create()
    lip.prefill(kv, lip.tokenize("x " * 200)[:160])          # exactly 10 pages
    before = pages_used(lip)
    fork = lip.kv_fork(kv)
    lip.prefill(fork, [42])
    assert pages_used(lip) - before == 1
    assert lip.kv_stat(fork)["pages"] == 11


def test_extract_and_merge_keep_exactly_the_entries_asked(lip):
    a_tokens = lip.tokenize("Alpha document about apples and orchards. " * 3)
    b_tokens = lip.tokenize("Beta document about bees and honey.")
    a, b = lip.kv_create(), lip.kv_create()
    lip.prefill(a, a_tokens)
    lip.prefill(b, b_tokens)
    n = len(a_tokens)

    part = lip.kv_extract(a, [(0, 16), (20, n)])
    assert lip.kv_tokens(part) == a_tokens[:16] + a_tokens[20:]
    assert lip.kv_positions(part) == list(range(16)) + list(range(20, n))

    merged = lip.kv_merge([a, b])
    assert lip.kv_tokens(merged) == a_tokens + b_tokens
    # positions stay as stored: b's entries keep positions 0..len(b)-1
    assert lip.kv_positions(merged) == list(range(n)) + list(range(len(b_tokens)))
    assert lip.kv_stat(merged)["last_position"] == len(b_tokens) - 1

    # Entries keep their K/V exactly: the merge's tensors are a's then b's, and the
    # extract's are the chosen entries of a.
    kv_a, kv_b = export_kv(lip, a), export_kv(lip, b)
    assert np.array_equal(export_kv(lip, merged), np.concatenate([kv_a, kv_b], axis=2))
    chosen = list(range(16)) + list(range(20, n))
    assert np.array_equal(export_kv(lip, part), kv_a[:, :, chosen])


def export_kv(lip, kv) -> np.ndarray:
    """The K/V tensor [layers, 2, n, kv_heads, head_dim] of a `kv_export` blob."""
    import struct

    import msgpack
    blob = lip.kv_export(kv)[:-4]          # the last 4 bytes are a CRC-32
    assert blob.startswith(b"SYKV2\n")
    at = len(b"SYKV2\n")
    (head_len,) = struct.unpack_from("<I", blob, at)
    meta = msgpack.unpackb(blob[at + 4: at + 4 + head_len])
    return np.frombuffer(blob, dtype=meta["numpy_dtype"],
                         offset=at + 4 + head_len).reshape(meta["shape"])


def test_extract_shares_aligned_pages(lip):
    kv = lip.kv_create()
    lip.prefill(kv, lip.tokenize("page " * 100)[:64])      # 4 full pages
    before = pages_used(lip)
    head = lip.kv_extract(kv, [(0, 32)])                   # 2 whole pages: shared
    assert pages_used(lip) - before == 0
    odd = lip.kv_extract(kv, [(1, 33)])                    # misaligned: copied
    assert pages_used(lip) - before == 2
    assert lip.kv_tokens(head) == lip.kv_tokens(kv)[:32]
    assert lip.kv_tokens(odd) == lip.kv_tokens(kv)[1:33]


def test_truncate_then_extend(lip):
    tokens = lip.tokenize("one two three four five six seven eight nine ten")
    kv = lip.kv_create()
    lip.prefill(kv, tokens)
    lip.kv_truncate(kv, 4)
    assert lip.kv_tokens(kv) == tokens[:4]
    d = lip.pred(kv, tokens[4:])
    ref = lip.pred(lip.kv_create(), tokens)
    assert np.abs(d.logits - ref.logits).max() <= 1e-4


def test_empty_pred_repredicts_from_last_entry(lip):
    tokens = lip.tokenize("Once upon a time")
    kv = lip.kv_create()
    first = lip.pred(kv, tokens)
    again = lip.pred(kv, [])
    assert lip.kv_tokens(kv) == tokens
    assert np.abs(first.logits - again.logits).max() <= 1e-4
    assert again.cost["computed"] == 1


def test_export_import_round_trip_is_bit_exact(lip):
    tokens = lip.tokenize("Persist me, bit for bit.")
    kv = lip.kv_create()
    lip.prefill(kv, tokens)
    blob = lip.kv_export(kv)
    copy = lip.kv_import(blob)
    assert lip.kv_tokens(copy) == tokens
    probe = lip.tokenize(" And")
    a = lip.pred(kv, probe)
    b = lip.pred(copy, probe)
    assert np.array_equal(a.logits, b.logits)


@pytest.mark.slow
def test_reads_do_not_wait_for_a_generation_on_the_object(lip):
    """stat/fork answer from the committed entries while a long generate runs on the
    same object (so `ls`/`cp` on a busy cache file never block)."""
    import threading
    prompt = lip.tokenize("Count slowly: one, two, three,")
    kv = lip.kv_create()
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=lip.generate(kv, prompt, max_tokens=120, ignore_eos=True)))
    worker.start()
    try:
        seen = []
        while worker.is_alive() and len(seen) < 3:
            st = lip.kv_stat(kv)
            if st["tokens"] >= len(prompt) and lip.stats()["pending_calls"]:
                fork = lip.kv_fork(kv)
                seen.append((st["tokens"], lip.kv_tokens(fork)))
    finally:
        worker.join()
    assert seen, "the generate finished before any read"
    final = prompt + result["out"][:-1]
    for tokens, snapshot in seen:
        assert len(snapshot) >= tokens and snapshot == final[: len(snapshot)]
        assert len(snapshot) < len(final)
