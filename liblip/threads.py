"""A thread per branch, the paper's way of running a program's branches (forks of one
cache, parallel questions, sampled choices) at once: each branch's calls reach predd
while the others wait, and predd batches them into the same steps."""
from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(work: Callable[[int], object], count: int) -> None:
    """work(i) for i in range(count), one thread each (one alone runs on the caller's
    thread). Returns when all have ended; then raises the first error one of them
    raised."""
    if count == 1:
        work(0)
        return
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:   # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
