"""KV memory among the OpenAI program's requests: what a request does when predd says
there is no room for its call (EDQUOT: the program's uid is at its quota; ENOSPC: the
pool is full).

As in vLLM, which queues requests and preempts running ones rather than fail them, no
request fails because others hold the memory:
* a request takes a place for each thread of it that holds memory (a batch's prompts
  times their choices) when it starts, and gives each back as that thread ends;
* requests wait in a queue per caller (scope) while `max_running` places are taken,
  the callers taken in turn and each caller's requests first come first started, so one
  caller's flood does not hold back the others. A turn gives its caller one free place;
  a request asking for several keeps those its turns gave it (`reserved`) until it has
  them all, and then starts: a batch of 64 prompts takes 64 turns, as 64 requests
  would, not one, and never more places than there are. Requests gather places
  together only while all they ask for fits in `max_running` (`collecting`; another's
  turns pass meanwhile), so two cannot each hold part of what both need. Past
  `max_queued` places asked
  for in all, or a quarter of that by one caller: 429, EAGAIN. None starts while a
  running one waits for room, so new arrivals do not take the pages the waiting ones
  need;
* for room (below), only places a thread uses count: those a request holds for parts
  not yet started (`idle`) do not make it or others wait;
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
        # per scope, in turn order: (item, start, places) in arrival order
        self.queues: dict[str, collections.deque] = {}
        self.queued = 0         # places the queued requests ask for
        self.running = 0        # places of the requests started and not ended
        self.idle = 0           # of those, held for parts not started (`use`)
        # per caller gathering places: [kept, needed] of its first request
        self.collecting: dict[str, list[int]] = {}
        self.waiting = 0        # of those, waiting for room with their caches
        self.parked = 0         # of those, waiting with their caches given back
        self.ended = 0          # requests ended and caches given back so far: a clock

    # ------------------------------------------------------------ admission

    def submit(self, item, start: Callable[[], None], scope: str = "",
               places: int = 1) -> bool:
        """Queue `item` for `scope` (a caller), to hold `places` once started (it `end`s
        each); `start()` is called (under no lock) when it may run. False when the queue
        is full, in all or for this caller."""
        places = max(1, places)
        with self.cond:
            if self.queued + places > max(self.max_queued, places) or \
                    self.backlog(scope) + places > max(1, self.max_queued // 4, places):
                return False
            self.queues.setdefault(scope, collections.deque()).append((item, start, places))
            self.queued += places
            ready = self._take()
        self._start(ready)
        return True

    def withdraw(self, item) -> bool:
        """Take a queued `item` out (a request cancelled before it started)."""
        with self.cond:
            found = next(((scope, entry) for scope, q in self.queues.items() for entry in q
                          if entry[0] is item), None)
            if found is None:
                return False
            scope, entry = found
            if entry is self.queues[scope][0]:
                self.collecting.pop(scope, None)   # the places kept for it are free again
            self.queues[scope].remove(entry)
            self.queued -= entry[2]
            if not self.queues[scope]:
                del self.queues[scope]      # (its only request was its first)
            ready = self._take()            # one waiting behind it may fit now
        self._start(ready)
        return True

    @property
    def reserved(self) -> int:
        """Free places kept for the requests gathering them."""
        return sum(kept for kept, _ in self.collecting.values())

    def backlog(self, scope: str) -> int:
        """The places `scope`'s queued requests ask for."""
        return sum(entry[2] for entry in self.queues.get(scope, ()))

    def _take(self) -> list:
        """Whom to start now, while a place is free and not kept: the callers in turn
        (each turn to the back of the order), a turn giving its caller's first request
        a free place; it starts once it has the places it asks for (at most
        `max_running`: a request of more starts alone), keeping those it has meanwhile
        where what every gathering request asks for fits in `max_running` (else its
        turn passes)."""
        ready = []
        while self.queues and self.running + self.reserved < self.max_running and \
                self.waiting + self.parked == 0:
            scope = next(iter(self.queues))
            q = self.queues.pop(scope)
            item, start, places = q[0]
            need = min(places, self.max_running)
            kept = self.collecting.get(scope, [0, need])
            if kept[0] + 1 < need:                            # not yet
                if scope in self.collecting or need + sum(
                        n for _, n in self.collecting.values()) <= self.max_running:
                    kept[0] += 1                              # this place kept for it
                    self.collecting[scope] = kept
                self.queues[scope] = q
                continue
            q.popleft()
            self.collecting.pop(scope, None)
            self.queued -= places
            self.running += places
            self.idle += places - 1             # its own thread uses one
            ready.append((item, start))
            if q:
                self.queues[scope] = q
        return ready

    def wake(self) -> None:
        """Every thread waiting here looks again (a request was cancelled)."""
        with self.cond:
            self.cond.notify_all()

    def use(self, places: int) -> None:
        """A started request's parts take `places` of its idle places (threads that
        hold memory: a thread refused room sees them as others making progress, or
        waiting)."""
        with self.cond:
            self.idle -= places

    def end(self, places: int = 1, idle: int = 0) -> None:
        """A started request gives back `places` of its places, `idle` of them unused (a
        thread of it that held memory ended; the rest when it ends): their pages are
        back; queued ones may start."""
        with self.cond:
            self.running -= places
            self.idle -= idle
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
            others = self.running - self.idle - 1 - self.waiting - self.parked   # going on
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
                                   self.running - self.idle == self.parked)  # none holds any
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
