"""A directory's readdir order: a stable position for every name.

A name gets a position when it is added, larger than every position given before, and
keeps it until it is removed; a readdir offset is a position, so a listing resumed at
an offset neither repeats nor skips a name that stayed, whatever else changed in between
(POSIX allows either for names added or removed meanwhile). Positions 1 and 2 are "."
and "..", so the first name gets 3.

Costs, so a directory of 100,000 names costs no more per operation than one of 10:
`add`, `remove` and `position` are O(1); `after(pos)` finds its start by bisection and
then costs O(1) per name it yields, plus the removed positions it steps over. The
position list is compacted once removed positions outnumber live ones, so a whole
listing costs O(names), and so does what removals leave behind, amortised.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

FIRST = 3            # 1 and 2 are "." and ".."
SLACK = 32           # removed positions tolerated in a small listing before compacting


class Listing:
    def __init__(self, names: Iterable[bytes] = ()) -> None:
        self.next_pos = FIRST
        self._pos: dict[bytes, int] = {}       # name -> position
        self._name: dict[int, bytes] = {}      # position -> name (live ones only)
        self._slots: list[int] = []            # increasing; may hold removed positions
        for name in names:
            self.add(name)

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, name: bytes) -> bool:
        return name in self._pos

    def add(self, name: bytes) -> int:
        """Give `name` (not listed yet) the next position; that position."""
        assert name not in self._pos, "a name is listed once"
        pos = self.next_pos
        self.next_pos += 1
        self._pos[name] = pos
        self._name[pos] = name
        self._slots.append(pos)
        return pos

    def remove(self, name: bytes) -> None:
        del self._name[self._pos.pop(name)]
        if len(self._slots) > 2 * len(self._name) + SLACK:
            self._slots = [p for p in self._slots if p in self._name]

    def position(self, name: bytes) -> int:
        return self._pos[name]

    def after(self, pos: int) -> Iterator[tuple[int, bytes]]:
        """(position, name) of the names past `pos`, in position order. Lazy: do not
        change the listing while iterating."""
        slots = self._slots
        for i in range(bisect.bisect_right(slots, pos), len(slots)):
            name = self._name.get(slots[i])
            if name is not None:
                yield slots[i], name
