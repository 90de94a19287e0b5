"""A request's parts in the OpenAI program (openai_lip/decode.py `run_parts`): a batch's
prompts and a prompt's choices, each a holder of memory in the room while it runs (a
place of the request's, given back as the part ends), the first real failure halting
the others and answering the request, and a finished choice's kept cache the first
thing given back for room. Real threads, fake caches; no daemon."""
from __future__ import annotations

import threading

import pytest

import liblip as lip
from openai_lip import decode
from openai_lip.decode import Cancelled, Request, run_parts
from openai_lip.room import Room


def started(places: int = 1) -> tuple[Room, Request]:
    room = Room(lambda: False)
    req = Request("r", room, places)
    assert room.submit(req, lambda: None, "", places) and room.running == places
    return room, req


def test_each_part_counts_in_the_room_while_it_runs():
    room, req = started(3)
    all_in, gate = threading.Barrier(4, timeout=10), threading.Event()

    def part(i: int) -> None:
        all_in.wait()
        gate.wait(10)
    t = threading.Thread(target=run_parts, args=(req, part, 3))
    t.start()
    all_in.wait()
    assert room.running == 3 and room.ended == 0
    gate.set()
    t.join()
    assert room.running == 1 and room.ended == 2     # the request's own place
    req.release(req.places)                          # ... given back as it ends
    assert room.running == 0 and req.places == 0
    req.release(1)                                   # never more than it holds
    assert room.running == 0 and room.ended == 3


def test_the_first_real_failure_is_the_answer_and_halts_the_rest():
    """An inner choice fails; the other prompt, halted, fails with an error halting
    caused (a room error, a freed cache): the request's error is the first one."""
    room, req = started(3)
    real = RuntimeError("the grammar refused every token")

    def prompt(i: int) -> None:
        if i == 0:
            def choice(j: int) -> None:
                if j == 0:
                    raise real
                req.halted.wait()
                req.check()                            # Cancelled: halted
            run_parts(req, choice, 2)
        else:
            req.halted.wait()
            raise lip.LipError("EBADF", "a cache freed by the halt")
    with pytest.raises(RuntimeError) as err:
        run_parts(req, prompt, 2)
    assert err.value is real and req.failure is real and not req.cancelled.is_set()
    assert room.running == 1                           # every part's count given back


def test_a_cancel_is_reported_as_a_cancel():
    room, req = started(2)

    def part(i: int) -> None:
        if i == 0:
            req.cancel()
        req.check()
    with pytest.raises(Cancelled):
        run_parts(req, part, 2)
    assert req.failure is None and room.running == 1


def test_a_halted_request_stops_where_it_finds_no_room(monkeypatch):
    closed = []
    monkeypatch.setattr(decode.lip, "kv_close", closed.append)
    room, req = started()
    req.fail(RuntimeError("another part failed"))
    with pytest.raises(Cancelled):
        req.no_room(lip.LipError("EDQUOT", "quota"), "kv")
    assert closed == []


def test_a_kept_cache_goes_back_first_when_a_call_finds_no_room(monkeypatch):
    closed = []
    monkeypatch.setattr(decode.lip, "kv_close", closed.append)
    room, req = started()
    req.spare = req.track("kept")
    assert req.no_room(lip.LipError("EDQUOT", "quota"), "mine") == "mine"   # try again
    assert closed == ["kept"] and req.spare is None and req.kvs == []
    with pytest.raises(lip.LipError):                  # not a room error: kept no longer
        req.no_room(lip.LipError("EINVAL", "bad"), "mine")
