"""KV memory among the OpenAI program's requests: what a request does when predd says
there is no room for its call (EDQUOT: the program's uid is at its quota; ENOSPC: the
pool is full).

As in vLLM, which queues requests and preempts running ones rather than fail them, no
request fails because others hold the memory:
* requests past `max_running` wait in a queue per caller (scope), the callers taken in
  turn and each caller's requests first come first started, so one caller's flood does
  not hold back the others; past `max_queued` in all, or a quarter of that for one
  caller: 429, EAGAIN. None starts while a running one waits for room, so new arrivals
  do not take the pages the waiting ones need;
* a refused call first has the prefix cache's files removed (their pages go back unless
  a request holds a fork of one) and is tried again;
* otherwise the request waits until another makes progress or ends, and tries again;
* when every other request holding memory waits too, the one that found it so gives its
  cache back (its tokens kept) and, once another has ended (or none holds memory any
  more), computes it again and goes on where it was: vLLM's recompute preemption;
* a request that is refused while no other holds memory fails with the error: it
  cannot fit (429 EDQUOT, 503 ENOSPC).
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import liblip as lip

ROOM_ERRORS = ("EDQUOT", "ENOSPC")
WAIT_S = 1.0        # a waiting request tries again at least this often


class Room:
    def __init__(self, drop_cache: Callable[[], bool], max_running: int = 64,
                 max_queued: int = 4096) -> None:
        self.drop_cache = drop_cache          # True when it removed something
        self.max_running, self.max_queued = max_running, max_queued
        self.cond = threading.Condition()
        self.queues: dict[str, collections.deque] = {}   # per scope, in turn order
        self.queued = 0
        self.running = 0        # started and not ended
        self.waiting = 0        # of those, waiting for room with their caches
        self.parked = 0         # of those, waiting with their caches given back
        self.ended = 0          # requests ended and caches given back so far: a clock

    # ------------------------------------------------------------ admission

    def submit(self, item, start: Callable[[], None], scope: str = "") -> bool:
        """Queue `item` for `scope` (a caller); `start()` is called (under no lock) when
        it may run. False when the queue is full, in all or for this caller."""
        with self.cond:
            mine = self.queues.get(scope)
            if self.queued >= self.max_queued or \
                    (mine is not None and len(mine) >= max(1, self.max_queued // 4)):
                return False
            self.queues.setdefault(scope, collections.deque()).append((item, start))
            self.queued += 1
            ready = self._take()
        self._start(ready)
        return True

    def withdraw(self, item) -> bool:
        """Take a queued `item` out (a request cancelled before it started)."""
        with self.cond:
            for scope, q in self.queues.items():
                for entry in q:
                    if entry[0] is item:
                        q.remove(entry)
                        self.queued -= 1
                        if not q:
                            del self.queues[scope]
                        return True
        return False

    def _take(self) -> list:
        """Whom to start now: a request of each caller in turn (the one served goes to
        the back of the turn order)."""
        ready = []
        while self.queues and self.running < self.max_running and \
                self.waiting + self.parked == 0:
            scope = next(iter(self.queues))
            q = self.queues.pop(scope)
            ready.append(q.popleft())
            if q:
                self.queues[scope] = q
            self.queued -= 1
            self.running += 1
        return ready

    def hold(self, n: int) -> None:
        """A started request goes on in n more threads that each hold memory (a batch's
        prompts, a prompt's choices): each counts as a request running, and `end`s when
        it is done, so a thread refused room sees its siblings as others making progress
        (or waiting), and queued requests start as they end."""
        with self.cond:
            self.running += n

    def wake(self) -> None:
        """Every thread waiting here looks again (a request was cancelled)."""
        with self.cond:
            self.cond.notify_all()

    def end(self) -> None:
        """A started request (or a thread it `hold`s) ended: its pages are back; queued
        ones may start."""
        with self.cond:
            self.running -= 1
            self.ended += 1
            self.cond.notify_all()
            ready = self._take()
        self._start(ready)

    # ------------------------------------------------------------ no room

    def no_room(self, exc: lip.LipError, kv: lip.KV, give_back: Callable[[lip.KV], None],
                rebuild: Callable[[list[int]], lip.KV], cancelled: threading.Event
                ) -> lip.KV:
        """After `exc` refused a call on `kv`: returns once trying again may succeed, with
        the cache to try on — `kv`, or a new one holding the same tokens when `kv` was
        given back (`give_back(kv)` closes it, `rebuild(tokens)` computes a new one).
        Raises `exc` when no other request holds memory, or when not a room error."""
        if exc.code not in ROOM_ERRORS or cancelled.is_set():
            raise exc
        if self.drop_cache():
            return kv
        with self.cond:
            others = self.running - 1 - self.waiting - self.parked   # making progress
            if others > 0:
                self.waiting += 1
                clock = self.ended
                try:
                    self.cond.wait_for(lambda: self.ended != clock or cancelled.is_set(),
                                       timeout=WAIT_S)
                finally:
                    self.waiting -= 1
                    ready = self._take()
                self._start(ready)
                return kv
            if self.waiting == 0:
                raise exc               # no other request holds memory: it cannot fit
            self.parked += 1            # every other holder waits too: give this back
        try:
            tokens = lip.kv_tokens(kv)
            give_back(kv)
            with self.cond:
                self.ended += 1         # pages came back: the waiting try again
                clock = self.ended
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.ended != clock or cancelled.is_set() or
                                   self.running == self.parked)   # none holds any
        finally:
            with self.cond:
                self.parked -= 1
                ready = self._take()
            self._start(ready)
        if cancelled.is_set():
            raise exc
        return rebuild(tokens)

    @staticmethod
    def _start(ready: list) -> None:
        for _, start in ready:
            start()
