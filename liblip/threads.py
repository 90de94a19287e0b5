"""A thread per branch, the paper's way of running a program's branches (forks of one
cache, parallel questions, sampled choices) at once: each branch's calls reach predd
while the others wait, and predd batches them into the same steps."""
from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(work: Callable[[int], object], count: int) -> None:
    """work(i) for i in range(count), one thread each (one alone runs on the caller's
    thread). Returns when all have ended; then raises the first error one of them
    raised. Where a thread cannot start (the process is out of threads), that error is
    raised once the branches already started have ended, the others never run: a
    caller's cleanup never races a branch still running."""
    if count == 1:
        work(0)
        return
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:   # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    started: list[threading.Thread] = []
    try:
        for i in range(count):
            t = threading.Thread(target=guarded, args=(i,))
            t.start()
            started.append(t)
    finally:
        for t in started:
            t.join()
    if errors:
        raise errors[0]
