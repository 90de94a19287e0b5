"""The OpenAI program's prefix cache (openai_lip/prefix_cache.py) with its calls to predd
and the mount faked: none is made under its lock, and a file promised before a request
answers is found by the next request it would serve. Fake caches are lists of tokens;
real threads."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from types import SimpleNamespace

import pytest

from openai_lip import prefix_cache as pc
from openai_lip.prefix_cache import PrefixCache

PROMPT = list(range(100, 140))


class FakeLip:
    """Caches as lists; files as token lists in `files`; `gate` holds kv_create."""

    def __init__(self) -> None:
        self.files: dict[str, list[int]] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.LipError = pc.lip.LipError

    def kv_create(self) -> list[int]:
        assert self.gate.wait(10)
        return []

    @contextlib.contextmanager
    def kv_open(self, path: str):
        if path not in self.files:
            raise self.LipError("ENOENT", path)
        yield self.files[path]

    def kv_fork(self, kv: list[int]) -> list[int]:
        return list(kv)

    def kv_truncate(self, kv: list[int], n: int) -> None:
        del kv[n:]

    def kv_tokens(self, kv: list[int]) -> list[int]:
        return list(kv)

    def kv_save(self, kv: list[int], path: str) -> None:
        self.files[path] = list(kv)
        open(path, "w").close()


@pytest.fixture
def fake(monkeypatch) -> FakeLip:
    lip = FakeLip()
    monkeypatch.setattr(pc, "lip", SimpleNamespace(**{
        name: getattr(lip, name) for name in (
            "kv_create", "kv_open", "kv_fork", "kv_truncate", "kv_tokens", "kv_save",
            "LipError")}))
    return lip


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_a_call_waiting_for_predd_holds_up_no_other_lookup(tmp_path, fake):
    cache = PrefixCache(str(tmp_path))
    cache.store("alice", PROMPT, PROMPT)
    fake.gate.clear()                        # kv_create waits, as for a long step
    slow, _ = in_thread(cache.lookup, "bob", PROMPT)
    time.sleep(0.1)
    assert slow.is_alive()
    fast, got = in_thread(cache.lookup, "alice", PROMPT + [1, 2])   # a fork
    fast.join(2)
    done_meanwhile = not fast.is_alive()
    fake.gate.set()
    assert done_meanwhile and got == [(PROMPT, len(PROMPT))]
    slow.join(5)
    assert not slow.is_alive()


def test_a_promised_file_is_waited_for_by_the_request_it_serves(tmp_path, fake):
    cache = PrefixCache(str(tmp_path))
    promise = cache.promise("alice", PROMPT[:-1])
    follow, got = in_thread(cache.lookup, "alice", PROMPT + [7, 8])
    other, got_other = in_thread(cache.lookup, "bob", PROMPT + [7, 8])
    other.join(5)
    assert got_other == [([], 0)]            # another scope: nothing to wait for
    time.sleep(0.1)
    assert follow.is_alive()                 # waits for alice's file
    path = cache.keep(promise, "alice", list(PROMPT))
    follow.join(5)
    assert got == [(PROMPT, len(PROMPT))] and os.path.exists(path)
    assert cache.coming == {}


def test_a_promise_never_kept_holds_a_lookup_up_for_a_bounded_time(tmp_path, fake,
                                                                    monkeypatch):
    monkeypatch.setattr(pc, "COMING_WAIT_S", 0.2)
    cache = PrefixCache(str(tmp_path))
    cache.promise("alice", PROMPT)
    started = time.monotonic()
    assert cache.lookup("alice", PROMPT) == ([], 0)
    assert 0.2 <= time.monotonic() - started < 2


def test_a_failed_save_ends_its_promise(tmp_path, fake):
    cache = PrefixCache(str(tmp_path))
    promise = cache.promise("alice", PROMPT)

    def refuse(kv, path):
        raise fake.LipError("EIO", "no")
    pc.lip.kv_save = refuse
    with pytest.raises(fake.LipError):
        cache.keep(promise, "alice", list(PROMPT))
    assert cache.coming == {} and cache.moving == set() and cache.entries == {}


def test_a_longer_file_replaces_the_one_it_extends_and_the_oldest_go(tmp_path, fake):
    cache = PrefixCache(str(tmp_path), max_files=2)
    first = cache.store("alice", PROMPT, PROMPT[:20])
    longer = cache.store("alice", PROMPT, PROMPT)
    assert not os.path.exists(first) and list(cache.entries) == [longer]
    assert cache.store("alice", PROMPT, PROMPT[:30]) is None     # covered already
    b = cache.store("bob", PROMPT, PROMPT)
    c = cache.store("carol", PROMPT, PROMPT)
    assert list(cache.entries) == [b, c] and not os.path.exists(longer)


def test_a_refused_fork_keeps_the_file_and_a_vanished_one_is_forgotten(tmp_path, fake):
    """A file whose fork predd refused (no room, the rate limit) keeps its entry, so its
    pages still go when it is evicted or dropped; one gone from the disk is forgotten."""
    cache = PrefixCache(str(tmp_path))
    path = cache.store("alice", PROMPT, PROMPT)

    def refuse(kv):
        raise fake.LipError("ENOSPC", "no room")
    pc.lip.kv_fork = refuse
    assert cache.lookup("alice", PROMPT + [1]) == ([], 0)
    assert list(cache.entries) == [path]
    pc.lip.kv_fork = fake.kv_fork
    os.unlink(path)
    del fake.files[path]
    assert cache.lookup("alice", PROMPT + [1]) == ([], 0)
    assert cache.entries == {}
