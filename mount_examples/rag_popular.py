"""RAG serving whose cache policy is the program's own: documents' caches are files it
keeps by popularity, and every request is a fork.

A long-running LIP: requests as JSON lines on stdin, answers as JSON lines on stdout,
one thread per request:

    in:  {"id": 7, "doc": "d12", "question": "What ...?", "max_tokens": 32}
         ("question_tokens": [...] instead of "question": its user turn, tokenized)
    out: {"id": 7, "tokens": [...], "hit": true, "doc_tokens": 402,
          "question_tokens": 21, "question_cached": 10, "doc_computed": 0,
          "computed": 42, "swapped_in": 0}
         {"id": 7, "error": "ENOSPC", "message": "..."}

The policy (predd only keeps pages; what to keep is decided here):
* every request counts one use of its document: its popularity;
* a document's cache is the file DIR/NAME.kv, prefilled on a miss and held open by
  this program: the document's system turn and the next turn's header, the tokens
  every question starts with under the chat template (`user_header`: no question
  computes them again; a question that does not start with them forks the document
  back to its system turn); a request forks it (no document token is computed again);
* a request's fork, once answered, is truncated back to the document and the start its
  question shares with the document's previous question (the tokens questions on it
  have in common so far: a template's, the user turn's header at least; never the
  whole question) and kept for the document's next request (a spare): that request
  starts its question at once, without waiting a round trip to predd for its fork,
  and computes only what its question does not share with the spare's (a question
  that shares less has the spare cut back to what it does share). At most --spares of
  a document; a spare holds the pages past the file's last whole one, counted below,
  and spares go before files when room is short; a request that finds none while an
  answered request's fork is on its way back (the truncate, after that answer) waits
  for that one;
* the documents' caches and the requests' own pages must fit the KV memory (predd's
  pool, all tiers): before a request takes pages, the coldest idle unpinned files
  (fewest uses, then least recently used) are `rm`ed, or the request waits for others
  to end;
* the hottest cached documents, as many as fit in --pin of the device pool (or of
  --pool-pages, if smaller), are pinned: never removed, and kept on the device
  (`kv_policy(pin=True)`) where predd has more tiers than one.
With --no-cache every request prefills its document into a fresh cache (the baseline).

    python mount_examples/rag_popular.py --docs DIR [--dir rag-popular] [--pin 0.5]
        [--spares 8] [--pool-pages N] [--no-cache] [--report FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import liblip as lip
from common import chat, load_docs, system_prefix, write_report
from openai_lip.prefix_cache import common_prefix
from symphony_protocol import default_mount

MAX_REQUESTS = 64
ENOSPC_RETRIES = 20     # predd's pool is the truth; the count here should match it
ROOM_WAIT_S = 600.0      # only a guard: room comes back whenever a request ends


def system_for(doc: str) -> str:
    return f"Answer the question using this document.\nDocument: {doc}"


def prompt(doc: str, question: str, prefix: list[int] | None = None
           ) -> tuple[list[int], list[int]]:
    """(the document's tokens: the system turn, shared by every question on it; the
    question's tokens: its user turn and the assistant's header). `prefix`: the
    document's tokens, if known."""
    prefix = prefix or system_prefix(system_for(doc))
    whole = chat(question, system_for(doc))
    if whole[:len(prefix)] != prefix:
        raise lip.LipError("EINVAL", "the chat template does not extend the system turn")
    return prefix, whole[len(prefix):]


def user_header(doc: str = "x") -> list[int]:
    """The tokens every question's part of `prompt` begins with (the user turn's
    header): the common prefix of two unlike questions' parts."""
    a, b = prompt(doc, "A?")[1], prompt(doc, "Zebra!")[1]
    return a[:common_prefix(a, b)]


def pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


@dataclass(eq=False)
class Spare:
    """A fork of a document's file, answered and truncated back to the document and
    `ext`: the start of a question, which the document's next question may share."""
    kv: lip.KV
    ext: list[int]
    pages: int                        # its own: those past the file's last whole page


@dataclass(eq=False)
class Cached:
    """One document's cache file: its handle (read-write, held open), its tokens (the
    document's and the user turn's header) and its pages."""
    name: str
    tokens: int
    pages: int
    kv: lip.KV | None = None          # None while it is being prefilled
    readers: int = 0                  # requests whose forks share its pages
    pinned: bool = False
    computed: int = 0                 # document tokens its prefill computed
    ready: threading.Event = field(default_factory=threading.Event)
    failed: str = ""
    spares: list[Spare] = field(default_factory=list)
    returning: int = 0                # answered requests whose forks are not back yet


class DocCache:
    """The documents' files and the memory they and the requests hold, in pages.

    `used` counts the files' pages and their spare forks', `reserved` the running
    requests' own pages
    (question, answer, a copied last page). Requests start in arrival order, each
    when its own pages and, on a miss, its document's fit `capacity`, all at once (a
    waiting request holds nothing, so waits end); the coldest idle unpinned files are removed to make room
    (a file a request's fork shares is never removed: its pages would not come back
    before the request ends). All fields are guarded by `cond`."""

    def __init__(self, directory: str, capacity: int, device_pages: int, page: int,
                 pin: float, tiers: bool, spares: int = 8) -> None:
        self.dir = directory
        self.spares = spares
        self.capacity = capacity
        self.pin_pages = int(pin * min(device_pages, capacity))
        self.page = page
        self.tiers = tiers
        self.files: dict[str, Cached] = {}
        self.uses: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.questions: dict[str, list[int]] = {}    # each document's latest question
        self.tick = 0
        self.used = 0
        self.reserved = 0
        self.line: collections.deque = collections.deque()   # tickets of waiting requests
        self.cond = threading.Condition()
        self.counters = {"hits": 0, "misses": 0, "removed": 0, "enospc_retries": 0,
                         "max_pages": 0, "pin_calls": 0, "room_waits": 0,
                         "spare_forks": 0}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.kv")

    # ------------------------------------------------------------ room

    def _heat(self, name: str) -> tuple[int, int]:
        return self.uses.get(name, 0), self.last.get(name, 0)

    def _room(self, need: int, keep: str = "") -> bool:
        """Whether `need` more pages fit, after removing the coldest idle unpinned
        files (never `keep`) if that is what it takes."""
        while self.used + self.reserved + need > self.capacity:
            spared = [c for c in self.files.values() if c.spares]
            if spared:               # a spare is one fork to make again: it goes first
                self._drop_spares(min(spared, key=lambda c: self._heat(c.name)))
                continue
            idle = [c for c in self.files.values() if c.kv is not None and
                    c.readers == 0 and not c.pinned and c.name != keep]
            if not idle:
                return False
            self._remove(min(idle, key=lambda c: self._heat(c.name)))
        return True

    def _admit(self, need, keep: str = "") -> None:
        """Wait until this request is the first in line and `need()` pages fit, then
        leave the line; ENOSPC if no request is running (nothing would change) or
        after ROOM_WAIT_S. First come, first served: requests that need less do not
        starve one that needs more. A waiting request holds no pages."""
        ticket = object()
        self.line.append(ticket)
        deadline = time.monotonic() + ROOM_WAIT_S
        try:
            while self.line[0] is not ticket or not self._room(need(), keep):
                left = deadline - time.monotonic()
                if self.line[0] is ticket and (self.reserved == 0 or left <= 0):
                    raise lip.LipError(
                        "ENOSPC", f"{need()} pages do not fit: {self.used} in files "
                        f"({self.pin_pages} may be pinned), {self.reserved} held by "
                        f"requests, of {self.capacity}")
                self.counters["room_waits"] += 1
                self.cond.wait(max(left, 0.01))
        finally:
            self.line.remove(ticket)
            self.cond.notify_all()

    def _remove(self, c: Cached) -> None:
        """`rm` the file. Emptying it first gives its pages back now: the kernel sends
        the last close to kvfsd after close() returns, and it frees them after that."""
        self._drop_spares(c)
        del self.files[c.name]
        self.counters["removed"] += 1
        lip.kv_truncate(c.kv, 0)
        os.unlink(self.path(c.name))
        lip.kv_close(c.kv)
        self.used -= c.pages

    def _drop_spares(self, c: Cached) -> None:
        while c.spares:
            spare = c.spares.pop()
            lip.kv_close(spare.kv)
            self.used -= spare.pages

    def _repin(self) -> None:
        """Pin the hottest cached documents that fit in the pin budget; unpin the rest."""
        budget = self.pin_pages
        for c in sorted((c for c in self.files.values() if c.kv is not None),
                        key=lambda c: self._heat(c.name), reverse=True):
            want = c.pages <= budget
            budget -= c.pages if want else 0
            if want != c.pinned:
                c.pinned = want
                if self.tiers:
                    try:
                        lip.kv_policy(c.kv, pin=want)
                        self.counters["pin_calls"] += 1
                    except lip.LipError as exc:
                        if exc.code != "EDQUOT":
                            raise
                        c.pinned = False

    # ------------------------------------------------------------ requests

    def begin(self, own: int) -> None:
        """Hold `own` pages for a request that uses no file (--no-cache)."""
        with self.cond:
            self._admit(lambda: own)
            self.reserved += own
            self._high_water()

    def end(self, own: int) -> None:
        with self.cond:
            self.reserved -= own
            self.cond.notify_all()

    def _high_water(self) -> None:
        self.counters["max_pages"] = max(self.counters["max_pages"], self.used + self.reserved)

    def acquire(self, name: str, doc: list[int], own: int) -> tuple[Cached, bool]:
        """The document's cache, prefilled here on a miss, with one more reader, and
        `own` pages held for the request; and whether it was a hit (no document token
        computed by this request). `release` gives both back."""
        with self.cond:
            self.tick += 1
            self.uses[name] = self.uses.get(name, 0) + 1
            self.last[name] = self.tick
            doc_pages = pages(len(doc), self.page)
            self._admit(lambda: own + (0 if name in self.files else doc_pages), keep=name)
            self.reserved += own
            c = self.files.get(name)
            mine = c is None
            if mine:
                c = self.files[name] = Cached(name, len(doc), doc_pages)
                self.used += c.pages
            c.readers += 1
            self._high_water()
        try:
            if mine:
                self._fill(c, doc)
            else:
                c.ready.wait()
            if c.failed:
                raise lip.LipError("EIO", f"{name}: {c.failed}")
        except BaseException:
            self.release(c, own)
            raise
        with self.cond:
            self.counters["misses" if mine else "hits"] += 1
            self._repin()
        return c, not mine

    def _fill(self, c: Cached, doc: list[int]) -> None:
        try:
            os.makedirs(self.dir, exist_ok=True)
            kv = lip.kv_open(self.path(c.name), write=True, create=True)
            try:
                cost = self.retry(lambda: lip.prefill(kv, doc),
                                  undo=lambda: lip.kv_truncate(kv, 0))
            except BaseException:
                lip.kv_close(kv)
                raise
            c.kv, c.computed = kv, cost.get("computed", 0)
        except BaseException as exc:
            c.failed = f"{type(exc).__name__}: {exc}"
            with self.cond:
                self.files.pop(c.name, None)
                self.used -= c.pages
                if os.path.exists(self.path(c.name)):
                    os.unlink(self.path(c.name))
                self.cond.notify_all()
            raise
        finally:
            c.ready.set()

    def answered(self, c: Cached) -> None:
        """A request on `c` is answered: its fork comes back (`release`) once truncated."""
        with self.cond:
            c.returning += 1

    def shared_start(self, name: str, question: list[int]) -> int:
        """How many tokens `question` starts with that the document's previous question
        did too (0 for its first); it becomes the previous one."""
        with self.cond:
            before = self.questions.get(name)
            self.questions[name] = question
        return common_prefix(question, before) if before else 0

    def spare_pages(self, c: Cached, tokens: int) -> int:
        """The pages of a fork of `c` cut back to `tokens` (at least the file's) that
        are its own: the file's partial last page, copied, and those after it."""
        return pages(tokens, self.page) - c.tokens // self.page

    def take_spare(self, c: Cached) -> Spare | None:
        """A fork of the document left by an earlier request, if one is kept (its page
        is the request's own from now on). Where none is kept but an answered request's
        is on its way back (a truncate, one round trip to predd like a fork's), it waits
        for that one: so the next request reuses it however the threads interleave."""
        with self.cond:
            while not c.spares and c.returning:
                self.cond.wait()
            if not c.spares:
                return None
            spare = c.spares.pop()
            self.used -= spare.pages
            self.counters["spare_forks"] += 1
            return spare

    def release(self, c: Cached, own: int, spare: Spare | None = None,
                answered: bool = False) -> None:
        """The request is over (`answered`: it had said so): its pages are given back,
        and `spare` (its fork, truncated back) is kept for the next request if there is
        room for it, else closed."""
        with self.cond:
            c.readers -= 1
            c.returning -= answered
            self.reserved -= own
            keep = (spare is not None and self.files.get(c.name) is c
                    and len(c.spares) < self.spares
                    and self.used + self.reserved + spare.pages <= self.capacity)
            if keep:
                c.spares.append(spare)
                self.used += spare.pages
                self._high_water()
            self.cond.notify_all()
        if spare is not None and not keep:
            lip.kv_close(spare.kv)

    def retry(self, call, undo):
        """call(); on ENOSPC (pages of a file just closed are freed when kvfsd sees
        the release, a moment later) undo(), wait a little and try again."""
        for attempt in range(ENOSPC_RETRIES):
            try:
                return call()
            except lip.LipError as exc:
                if exc.code != "ENOSPC" or attempt == ENOSPC_RETRIES - 1:
                    raise
                with self.cond:
                    self.counters["enospc_retries"] += 1
                undo()
                time.sleep(0.02 * (attempt + 1))

    def close(self) -> None:
        with self.cond:
            for c in list(self.files.values()):
                self._drop_spares(c)
                if c.kv is not None:
                    lip.kv_close(c.kv)

    def report(self) -> dict:
        with self.cond:
            return {**self.counters, "capacity": self.capacity, "pin_pages": self.pin_pages,
                    "files": sorted(self.files), "pinned": sorted(
                        n for n, c in self.files.items() if c.pinned),
                    "uses": dict(sorted(self.uses.items()))}


class Server:
    def __init__(self, args) -> None:
        self.args = args
        info = lip.info()
        self.page = info["page_size"]
        self.tiers = bool(info.get("host_pages") or info.get("disk_pages"))
        capacity = args.pool_pages or (info["pages_total"] + info.get("host_pages", 0)
                                       + info.get("disk_pages", 0))
        root = args.dir if os.path.isabs(args.dir) else os.path.join(default_mount(), args.dir)
        self.cache = DocCache(root, capacity, info["pages_total"], self.page, args.pin,
                              self.tiers, args.spares)
        self.no_cache = args.no_cache
        self.docs = load_docs(args.docs, {})
        self.doc_tokens: dict[str, list[int]] = {}
        self.header = user_header()
        self.lock = threading.Lock()
        self.out_lock = threading.Lock()
        self.slots = threading.Semaphore(MAX_REQUESTS)

    def send(self, obj: dict) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self.out_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    def tokens(self, msg: dict) -> tuple[str, list[int], list[int]]:
        """The request's document name, the document's tokens (templated once) and the
        question's: `question_tokens` as given (a front end that tokenized them), or
        `question` templated here."""
        name, question, given = msg.get("doc"), msg.get("question"), msg.get("question_tokens")
        if not isinstance(name, str) or not (isinstance(question, str) or (
                isinstance(given, list) and given
                and all(isinstance(t, int) for t in given))):
            raise lip.LipError("EINVAL", "want doc: str and question: str or "
                               "question_tokens: [int] (not empty)")
        if name not in self.docs:
            raise lip.LipError("ENOENT", f"no document {name!r}")
        with self.lock:
            known = self.doc_tokens.get(name)
        if known is None:
            known = system_prefix(system_for(self.docs[name]))
            with self.lock:
                self.doc_tokens.setdefault(name, known)
        if isinstance(given, list):
            return name, known, given
        return name, *prompt(self.docs[name], question, known)

    def handle(self, msg: dict) -> None:
        rid = msg.get("id")
        sent = False

        def reply(obj: dict) -> None:
            nonlocal sent
            sent = True
            self.send({"id": rid, **obj})
        try:
            self.answer(msg, reply)
        except Exception as exc:     # noqa: BLE001 - one request fails, not the program
            code = exc.code if isinstance(exc, lip.LipError) else "EIO"
            text = str(exc) if isinstance(exc, lip.LipError) else f"{type(exc).__name__}: {exc}"
            if not sent:
                reply({"error": code, "message": text})
            else:                    # answered; its clean-up failed
                print(f"rag_popular: request {rid}: {code}: {text}", file=sys.stderr)
        finally:
            self.slots.release()

    def answer(self, msg: dict, reply) -> None:
        """Answer one request with reply(); then free what it used (after the answer,
        off the request's latency)."""
        max_tokens = msg.get("max_tokens", 32)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise lip.LipError("EINVAL", "max_tokens: an int > 0")
        name, doc, q = self.tokens(msg)
        if self.no_cache:
            return self.uncached(doc, q, max_tokens, reply)
        own = pages(self.page - 1 + len(q) + max_tokens, self.page)
        c, hit = self.cache.acquire(name, doc + self.header, own)
        shared = self.cache.shared_start(name, q)
        kv = spare = None
        answered = False
        try:
            got = self.cache.take_spare(c)
            kv, ext = (got.kv, got.ext) if got else (lip.kv_fork(c.kv), self.header)
            # the question after what it shares with the fork's (a spare's start of an
            # earlier question, or the file's header), the rest cut off; one token at
            # least is fed, for its logits
            cached = min(common_prefix(q, ext), len(q) - 1)
            start = len(doc) + cached
            if cached < len(ext):
                lip.kv_truncate(kv, start)
            out = self.cache.retry(
                lambda: lip.generate(kv, q[cached:], max_tokens=max_tokens, ignore_eos=True),
                undo=lambda: lip.kv_truncate(kv, start))
            self.cache.answered(c)
            answered = True
            reply({"tokens": list(out), "hit": hit, "doc_tokens": len(doc),
                   "question_tokens": len(q), "question_cached": cached,
                   "doc_computed": 0 if hit else c.computed,
                   "computed": out.cost.get("computed", 0),
                   "swapped_in": out.cost.get("swapped_in", 0)})
            # the next one's fork: the document and what this question shares with the
            # one before it (the header at least), if it starts with the header
            keep = min(max(shared, len(self.header)), len(q) - 1)
            if q[:len(self.header)] == self.header and keep >= len(self.header):
                lip.kv_truncate(kv, len(doc) + keep)
                spare = Spare(kv, q[:keep], self.cache.spare_pages(c, len(doc) + keep))
                kv = None
        finally:
            if kv is not None:
                lip.kv_close(kv)
            self.cache.release(c, own, spare, answered)

    def uncached(self, doc: list[int], q: list[int], max_tokens: int, reply) -> None:
        own = pages(len(doc) + len(q) + max_tokens, self.page)
        self.cache.begin(own)
        try:
            with lip.kv_create() as kv:
                out = lip.generate(kv, doc + q, max_tokens=max_tokens, ignore_eos=True)
                reply({"tokens": list(out), "hit": False, "doc_tokens": len(doc),
                       "question_tokens": len(q), "doc_computed": len(doc),
                       "computed": out.cost.get("computed", 0), "swapped_in": 0})
        finally:
            self.cache.end(own)

    def serve(self) -> None:
        threads = []
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                self.send({"id": None, "error": "EINVAL", "message": "not a JSON line"})
                continue
            self.slots.acquire()
            t = threading.Thread(target=self.handle, args=(msg,), daemon=True)
            t.start()
            threads = [x for x in threads if x.is_alive()] + [t]
        for t in threads:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", required=True, help="a directory of NAME.txt documents")
    ap.add_argument("--dir", default="rag-popular", help="cache directory (under $KVFS_MOUNT)")
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="KV memory for documents and requests, in pages (default: "
                         "predd's, every tier)")
    ap.add_argument("--spares", type=int, default=8,
                    help="forks of a document kept for its next requests (0: a fork "
                         "per request)")
    ap.add_argument("--pin", type=float, default=0.5,
                    help="pin the hottest documents that fit in this share of the device pool")
    ap.add_argument("--no-cache", action="store_true",
                    help="prefill every request's document (no cache files)")
    ap.add_argument("--report", help="write the policy's counters here at the end (JSON)")
    args = ap.parse_args()
    server = Server(args)
    try:
        server.serve()
    finally:
        write_report(args.report, server.cache.report())
        server.cache.close()


if __name__ == "__main__":
    main()
