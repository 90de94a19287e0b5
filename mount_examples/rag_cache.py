"""RAG with the application's own cache policy, written against the KV file system.

Each document's prefilled cache is a file, `DIR/NAME.kv` under $KVFS_MOUNT. A query
that retrieves a cached document forks its file (no document token is computed); a
miss prefills a new file. The program keeps its statistics on the files themselves
(xattrs `user.rag.hits`, `user.rag.last`, so they outlive the process) and, under a
memory budget read the way `du` reads it (st_blocks), removes the least used cold
caches with a plain unlink — LFU, ties to the least recently used. The server has no
cache policy of its own to configure: the policy is this program.

    python mount_examples/rag_cache.py "What is the capital of France?" ... \
        [--budget 8M] [--dir rag] [--docs DIR] [--answer-tokens 8]
"""
from __future__ import annotations

import argparse
import os
import re
import time

import liblip as lip
from common import chat, greedy, load_docs, strip_eos, system_prefix, write_report

DOCS = {
    "paris": "Paris is the capital and largest city of France. It lies on the Seine "
             "and is known for the Eiffel Tower and the Louvre museum.",
    "tokyo": "Tokyo is the capital of Japan and one of the most populous cities in the "
             "world. Its metropolitan area is home to about 37 million people, and it is "
             "known for its train network, its food and its old temples.",
    "kv": "A KV cache stores the attention keys and values of tokens already processed, "
          "so a language model does not compute them again.",
    "fuse": "FUSE lets a program in user space implement a file system: the kernel "
            "forwards calls such as open, read and unlink to the daemon.",
}
STOP = {"the", "a", "an", "is", "of", "what", "which", "who", "how", "and", "in", "to",
        "does", "do", "it", "its", "for", "on"}
HITS, LAST = "user.rag.hits", "user.rag.last"


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower())) - STOP


def retrieve(query: str, docs: dict[str, str]) -> str:
    """The document sharing the most words with the query (ties: name order)."""
    q = words(query)
    return max(sorted(docs), key=lambda d: len(q & (words(docs[d]) | {d})))


def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text}")
    return int(float(m.group(1)) * units[m.group(2).upper()])


def system_for(doc: str) -> str:
    return f"Answer in one short sentence using this document.\nDocument: {doc}"


class DocCache:
    """The cache directory and the policy: what is there, how used, how big."""

    def __init__(self, directory: str, budget: int) -> None:
        self.dir = directory
        self.budget = budget
        os.makedirs(directory, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.kv")

    def files(self) -> list[str]:
        return sorted(f[:-3] for f in os.listdir(self.dir) if f.endswith(".kv"))

    def usage(self) -> int:
        """Bytes of KV memory held by the directory's caches, as `du` counts them."""
        return sum(os.stat(self.path(n)).st_blocks * 512 for n in self.files())

    def stat(self, name: str, attr: str) -> int:
        try:
            return int(os.getxattr(self.path(name), attr))
        except OSError:
            return 0

    def touch(self, name: str) -> None:
        os.setxattr(self.path(name), HITS, str(self.stat(name, HITS) + 1).encode())
        os.setxattr(self.path(name), LAST, str(time.time_ns()).encode())

    def open(self, name: str, system: list[int]) -> tuple[lip.KV, int]:
        """The document's cache (a hit opens the file, a miss fills a new one) and how
        many of its tokens this call computed."""
        if os.path.exists(self.path(name)):
            return lip.kv_open(self.path(name)), 0
        kv = lip.kv_open(self.path(name), write=True, create=True)
        return kv, lip.prefill(kv, system)["computed"]

    def evict(self, keep: str) -> list[str]:
        """Unlink the coldest caches (fewest hits, then least recent) until the
        directory fits the budget; `keep` (just used) goes last of all."""
        gone = []
        while self.usage() > self.budget:
            victims = [n for n in self.files() if n != keep] or [keep]
            victim = min(victims, key=lambda n: (self.stat(n, HITS), self.stat(n, LAST)))
            os.unlink(self.path(victim))
            gone.append(victim)
            if victim == keep:
                break
        return gone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("queries", nargs="+")
    ap.add_argument("--dir", default="rag", help="cache directory (under $KVFS_MOUNT)")
    ap.add_argument("--budget", type=parse_size, default=parse_size("8M"),
                    help="KV memory the directory may hold (bytes; K/M/G suffixes)")
    ap.add_argument("--docs", help="a directory of NAME.txt documents")
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--report")
    args = ap.parse_args()
    docs = load_docs(args.docs, DOCS)
    root = args.dir if os.path.isabs(args.dir) else os.path.join(
        os.environ.get("KVFS_MOUNT", "/mnt/kvfs"), args.dir)
    cache = DocCache(root, args.budget)

    log = []
    for query in args.queries:
        name = retrieve(query, docs)
        system = system_prefix(system_for(docs[name]))
        doc_kv, computed = cache.open(name, system)
        kv = lip.kv_fork(doc_kv)
        lip.kv_close(doc_kv)
        cache.touch(name)
        prompt = chat(query, system_for(docs[name]))
        answer, costs = greedy(kv, prompt[len(system):], args.answer_tokens)
        lip.kv_close(kv)
        evicted = cache.evict(keep=name)
        hit = computed == 0
        lip.send_to_user(f"{'hit ' if hit else 'miss'} {name}.kv  Q: {query}\n"
                         f"     A: {lip.detokenize(strip_eos(answer)).strip()}\n")
        for v in evicted:
            lip.send_to_user(f"     evicted {v}.kv\n")
        log.append({"query": query, "doc": name, "hit": hit, "doc_tokens": len(system),
                    "doc_computed": computed, "first_cost": costs[0],
                    "computed": sum(c["computed"] for c in costs), "evicted": evicted,
                    "usage": cache.usage(), "files": cache.files(), "answer": answer})
    write_report(args.report, {"budget": args.budget, "queries": log,
                               "hits": {n: cache.stat(n, HITS) for n in cache.files()}})


if __name__ == "__main__":
    main()
