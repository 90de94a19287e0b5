"""The predd replicas under one kvfsd: one PreddLink each, in the order given.

* A replica is named by its address exactly as given (`--predd ADDR`, repeatable); the
  first is replica 0. Every cache file has a home replica (`Node.replica`), and every
  predd call for it goes to that replica's link (`get`).
* An address kvfsd does not have (a state directory from a kvfsd with other replicas)
  gets a link that is never connected: calls on it fail with EIO, like a replica that
  is down, until the file is re-homed (kvfsd/migration.py).
* New files are spread over the live replicas in turn (`next_home`), skipping one
  whose last stats had no free page while another has some; `rehome auto` goes to the
  live one with the most free pages (by its last stats).
* `migrations`/`migrated_bytes` count every move of a cache between two live replicas
  (kv_export on one, kv_import on the other) and its export's length; `restored` the
  caches brought onto a replica from an fsync'd snapshot (their home was down or gone).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from kvfsd.predd_link import PreddLink, Timeouts
from symphony_protocol import same_endpoint_key


class Replicas:
    def __init__(self, addrs: list[str], log, timeouts: Timeouts = Timeouts()) -> None:
        if not addrs:
            raise ValueError("kvfsd needs at least one predd")
        self.log = log
        self.links: list[PreddLink] = []
        self._by_addr: dict[str, PreddLink] = {}
        for addr in addrs:
            if same_endpoint_key(addr) not in self._by_addr:      # one link per address
                link = PreddLink(addr, log, timeouts)
                self.links.append(link)
                self._by_addr[same_endpoint_key(addr)] = link
        self._absent: dict[str, PreddLink] = {}    # addresses kvfsd does not have
        self._turn = 0                              # the replica next_home tries first
        self.migrations = 0
        self.migrated_bytes = 0
        self.restored = 0

    def __iter__(self) -> Iterator[PreddLink]:
        return iter(self.links)

    def __len__(self) -> int:
        return len(self.links)

    @property
    def first(self) -> PreddLink:
        return self.links[0]

    def named(self, addr: str) -> PreddLink | None:
        """The replica a client names by `addr`: as kvfsd was given it, or the same ipc
        socket spelled another way (`ipc://a//b/../p.sock`); with one replica, whatever
        a client calls its predd (a LIP's $PREDD_ADDR need not be spelled as kvfsd's
        --predd). None: not one of kvfsd's."""
        link = self._by_addr.get(same_endpoint_key(addr))
        if link is None and len(self.links) == 1 and addr:
            return self.first
        return link

    def known(self, addr: str) -> bool:
        """Whether `addr` is one of kvfsd's replicas (as given, or the same ipc socket)."""
        return same_endpoint_key(addr) in self._by_addr

    def get(self, addr: str) -> PreddLink:
        """The link of replica `addr` ("" is replica 0); an address kvfsd does not have
        gets a link that is never connected (its calls fail with EIO)."""
        if not addr:
            return self.first
        link = self._by_addr.get(same_endpoint_key(addr))
        if link is None:
            link = self._absent.get(addr)
            if link is None:
                link = self._absent[addr] = PreddLink(addr, self.log, self.first.t)
        return link

    def first_live(self) -> PreddLink | None:
        return next((link for link in self.links if link.up), None)

    def next_home(self) -> PreddLink:
        """The replica a new file goes to: the live replicas in turn, from replica 0,
        skipping one whose last stats had no free page while another live one has some;
        with none live, replica 0 (its calls then fail with EIO)."""
        n = len(self.links)
        order = [self.links[(self._turn + i) % n] for i in range(n)]
        live = [link for link in order if link.up]
        if not live:
            return self.first
        roomy = [link for link in live if int(link.stats.get("pages_free", 1)) > 0]
        chosen = (roomy or live)[0]
        self._turn = (self.links.index(chosen) + 1) % n
        return chosen

    def most_free(self) -> PreddLink | None:
        """The live replica with the most free pages (last stats); ties: the first."""
        live = [link for link in self.links if link.up]
        if not live:
            return None
        return max(live, key=lambda link: (int(link.stats.get("pages_free", 0)),
                                           -self.links.index(link)))

    def report(self, files: Counter[str]) -> str:
        """`user.kv.replicas`: a line per replica, in order, `ADDR up|down files=N
        pages=USED/TOTAL calls=N` (`files`: how many files each homes; pages and calls
        in flight, its load: its last stats)."""
        lines = []
        for link in self.links:
            total = int(link.stats.get("pages_total", 0))
            used = total - int(link.stats.get("pages_free", total))
            lines.append(f"{link.addr} {'up' if link.up else 'down'} "
                         f"files={files.get(link.addr, 0)} pages={used}/{total} "
                         f"calls={int(link.stats.get('pending_calls', 0))}\n")
        return "".join(lines)

    def count_migration(self, nbytes: int) -> None:
        self.migrations += 1
        self.migrated_bytes += nbytes

    def close(self) -> None:
        for link in self.links:
            link.close()
