"""The OpenAI program's stdout (openai_lip/server.py, `Replies`): a sender never waits
for a stalled reader of stdout until QUEUED_BYTES wait; lines from many threads come
whole and in each sender's order; lines sent together go out in one write; `drain`
returns once all are written."""
from __future__ import annotations

import json
import threading

from openai_lip.server import Replies


class Stalled:
    """A stdout whose writes wait until `go` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.go.wait(10)
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_senders_do_not_wait_for_a_stalled_stdout_and_lines_keep_their_order():
    out = Stalled()
    replies = Replies(out)

    def send(k: int) -> None:
        for i in range(200):
            replies.send({"id": k, "i": i})
    senders = [threading.Thread(target=send, args=(k,)) for k in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(5)
    assert not any(t.is_alive() for t in senders)      # none waited on the pipe
    out.go.set()
    replies.drain()
    lines = [json.loads(line) for line in "".join(out.writes).splitlines()]
    assert len(lines) == 800 and len(out.writes) <= 3
    for k in range(4):
        assert [m["i"] for m in lines if m["id"] == k] == list(range(200))


def test_a_sender_waits_once_queued_bytes_are_full(monkeypatch):
    monkeypatch.setattr(Replies, "QUEUED_BYTES", 1000)
    out = Stalled()
    replies = Replies(out)
    replies.send({"first": True})                  # taken by the writer, which stalls
    done = threading.Event()

    def flood() -> None:
        for i in range(100):
            replies.send({"i": i, "pad": "x" * 40})
        done.set()
    t = threading.Thread(target=flood)
    t.start()
    assert not done.wait(0.5)                      # past 1,000 bytes: it waits
    out.go.set()
    assert done.wait(10)
    t.join(5)
    replies.drain()
    lines = "".join(out.writes).splitlines()
    assert len(lines) == 101 and json.loads(lines[-1])["i"] == 99
