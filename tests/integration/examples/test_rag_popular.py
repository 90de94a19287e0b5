"""mount_examples/rag_popular.py (the B2 benchmark's LIP) as a real process on a real
predd and a real kvfsd mount: its policy (count uses, pin the hot, rm the cold), one
prefill per document however many requests race for it, and what its answers cost."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.examples_fixtures import EXAMPLES, LineReader, example_env
from tests.integration.kvfs_fixtures import eventually

DOCS = {          # about five pages each; gamma no longer than beta
    "alpha": "The harbor opens at dawn. Boats bring fish, salt and copper to the market, "
             "and the traders weigh every crate on the old iron scale by the gate. By "
             "noon the square is full of voices, carts and gulls, and the bells ring twice.",
    "beta": "Glaciers move slowly down the valley, carving the rock and leaving long ridges "
            "of stones behind them. In spring the meltwater fills the lakes below, and the "
            "shepherds lead their flocks up to the high meadows until the first snow.",
    "gamma": "The archive keeps old maps of the canyon and letters from the first pilots. "
             "Visitors may read them in the quiet hall on the second floor, where the "
             "lamps stay lit all night and the clerks write down every request.",
}
QUESTION = "What does the document describe?"
NEW = 4


class Lip:
    """rag_popular.py, started on the mount; one JSON line per request."""

    def __init__(self, tmp_path, kvfs, *args: str) -> None:
        docs = tmp_path / "docs"
        docs.mkdir(exist_ok=True)
        for name, text in DOCS.items():
            (docs / f"{name}.txt").write_text(text)
        self.report = tmp_path / "report.json"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(EXAMPLES, "rag_popular.py"), "--docs", str(docs),
             "--dir", kvfs.path("rag"), "--report", str(self.report), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=example_env())
        self.out = LineReader(self.proc.stdout)
        self.answers: dict[int, dict] = {}

    def send(self, rid: int, **fields) -> None:
        self.proc.stdin.write(json.dumps({"id": rid, **fields}) + "\n")
        self.proc.stdin.flush()

    def reply(self, rid: int) -> dict:
        """The answer to request `rid` (answers come in the order they finish)."""
        while rid not in self.answers:
            msg = json.loads(self.out.wait_for('"id":'))
            self.answers[msg["id"]] = msg
        return self.answers.pop(rid)

    def ask(self, rid: int, doc: str) -> dict:
        return self.ask_text(rid, doc, QUESTION)

    def ask_text(self, rid: int, doc: str, question: str) -> dict:
        self.send(rid, doc=doc, question=question, max_tokens=NEW)
        return self.reply(rid)

    def close(self) -> dict:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0
        return json.loads(self.report.read_text())


@pytest.fixture
def rag_popular(example):
    """The program as a module, for its prompt helpers."""
    return example("rag_popular")


def sizes(rag, lip) -> tuple[dict, int, int, int]:
    """Each document's tokens, the question's tokens, the page size, and the user
    turn's header a document's file holds after them (counts)."""
    docs = {n: rag.prompt(t, QUESTION) for n, t in DOCS.items()}
    q = {len(qt) for _, qt in docs.values()}
    assert len(q) == 1
    header = rag.user_header()
    assert len(header) == 3 and all(qt[:3] == header for _, qt in docs.values())
    return ({n: len(d) for n, (d, _) in docs.items()}, q.pop(), lip.info()["page_size"],
            len(header))


def question_tokens(rag, doc: str) -> list[int]:
    return rag.prompt(DOCS[doc], QUESTION)[1]


@pytest.mark.slow
def test_keeps_the_popular_documents_and_removes_the_cold(kvfs, lip, tmp_path, rag_popular):
    tokens, q, page, h = sizes(rag_popular, lip)
    pages = {n: -(-(t + h) // page) for n, t in tokens.items()}     # a file's
    own = -(-(page - 1 + q + NEW) // page)
    pool = pages["alpha"] + pages["beta"] + own            # room for two documents
    assert pages["alpha"] <= pool // 2 < pages["alpha"] + pages["gamma"] <= pool - own
    assert pages["gamma"] <= pages["beta"]
    used = lip.stats()["pages_used"]
    rag = Lip(tmp_path, kvfs, "--pool-pages", str(pool), "--pin", "0.5")
    order = ["alpha", "alpha", "beta", "gamma", "beta", "alpha"]
    replies = [rag.ask(i, doc) for i, doc in enumerate(order)]
    report = rag.close()

    assert [r["hit"] for r in replies] == [False, True, False, False, False, True]
    # a miss computes the document and the user turn's header, a request the rest
    assert [r["doc_computed"] for r in replies] == [
        tokens["alpha"] + h, 0, tokens["beta"] + h, tokens["gamma"] + h, tokens["beta"] + h, 0]
    for r, doc in zip(replies, order):
        assert (r["doc_tokens"], r["question_tokens"]) == (tokens[doc], q)
        # the question after the file's header, and the answer: no earlier request's
        # fork kept more (the second's, kept with all but its last token, was closed)
        assert r["question_cached"] == h
        assert r["computed"] == q - h + NEW - 1
        assert len(r["tokens"]) == NEW
    # gamma pushed out beta (1 use; alpha, 2 uses, pinned), then beta pushed out gamma
    assert report["removed"] == 2
    assert (report["hits"], report["misses"]) == (2, 4)
    assert report["uses"] == {"alpha": 3, "beta": 2, "gamma": 1}
    assert report["pinned"] == ["alpha"]
    assert report["files"] == ["alpha", "beta"]
    assert report["max_pages"] <= pool
    # the second request's fork was the first's, truncated back to the document (the
    # third's miss closed it for room: beta's pages and a spare's copied page do not fit)
    assert report["spare_forks"] == 1
    assert replies[1]["tokens"] == replies[0]["tokens"] == replies[5]["tokens"]
    assert sorted(os.listdir(kvfs.path("rag"))) == ["alpha.kv", "beta.kv"]
    assert int(os.getxattr(kvfs.path("rag", "beta.kv"), "user.kv.tokens")) == tokens["beta"] + h
    # what is left in predd is the two files' caches, nothing of the requests
    want = used + pages["alpha"] + pages["beta"]
    assert eventually(lambda: lip.stats()["pages_used"] == want), lip.stats()["pages_used"]


@pytest.mark.slow
def test_one_prefill_for_concurrent_misses_and_bad_requests_fail_alone(kvfs, lip, tmp_path,
                                                                     rag_popular):
    tokens, q, _, h = sizes(rag_popular, lip)
    rag = Lip(tmp_path, kvfs)
    for rid in range(4):                                    # all in flight at once
        rag.send(rid, doc="gamma", question=QUESTION, max_tokens=NEW)
    replies = [rag.reply(rid) for rid in range(4)]
    rag.send(10, doc="nope", question=QUESTION)
    rag.send(11, doc=3, question=QUESTION)
    rag.send(12, doc="gamma", question=QUESTION, max_tokens=0)
    rag.send(16, doc="gamma", question_tokens=[], max_tokens=NEW)
    errors = [rag.reply(rid) for rid in (10, 11, 12, 16)]
    after = rag.ask(13, "gamma")
    rag.send(14, doc="gamma", question_tokens=question_tokens(rag_popular, "gamma"),
             max_tokens=NEW)
    pretokenized = rag.reply(14)
    # a question without the user turn's header: after the system turn, all computed
    rag.send(15, doc="gamma", question_tokens=question_tokens(rag_popular, "gamma")[h:],
             max_tokens=NEW)
    headless = rag.reply(15)
    report = rag.close()

    assert sorted(r["doc_computed"] for r in replies) == [0, 0, 0, tokens["gamma"] + h]
    assert sum(r["hit"] for r in replies) == 3
    # a fork of the file starts after its header; a spare, after all of the question
    # but its last token (the same question came before it)
    for r in replies + [after, pretokenized]:
        assert r["question_cached"] in (h, q - 1)
        assert r["computed"] == q - r["question_cached"] + NEW - 1
    assert len({tuple(r["tokens"]) for r in replies}) == 1     # the same question, greedy
    assert [e["error"] for e in errors] == ["ENOENT", "EINVAL", "EINVAL", "EINVAL"]
    assert (after["hit"], after["doc_computed"], after["tokens"]) == \
        (True, 0, replies[0]["tokens"])
    assert (pretokenized["hit"], pretokenized["question_tokens"], pretokenized["tokens"]) == \
        (True, q, replies[0]["tokens"])
    assert (headless["hit"], headless["question_tokens"], headless["question_cached"],
            headless["computed"]) == (True, q - h, 0, q - h + NEW - 1)
    assert int(os.getxattr(kvfs.path("rag", "gamma.kv"), "user.kv.tokens")) == tokens["gamma"] + h
    assert (report["hits"], report["misses"], report["removed"]) == (6, 1, 0)
    # 13, 14 and 15 came one at a time: each took a fork an answered request left (15's,
    # cut back to the system turn, is not kept)
    assert 3 <= report["spare_forks"] <= 6


TEMPLATE = "What does the document say about {}?"


@pytest.mark.slow
def test_a_question_computes_only_what_the_one_before_did_not_share(kvfs, lip, tmp_path,
                                                                   rag_popular):
    """Questions from one template: a spare keeps the start the document's last two
    questions shared, and the next question computes only its own tokens after that."""
    tokens, _, page, h = sizes(rag_popular, lip)
    asked = [TEMPLATE.format("the harbor"), TEMPLATE.format("the traders"),
             TEMPLATE.format("the market"), "Who weighs the crates?"]
    qs = [rag_popular.prompt(DOCS["alpha"], a)[1] for a in asked]
    common = rag_popular.common_prefix
    shared = common(qs[0], qs[1])              # the header, the template, " the"
    assert shared == h + 7 and common(qs[2], qs[1]) >= shared and common(qs[3], qs[2]) == h
    rag = Lip(tmp_path, kvfs)
    replies = [rag.ask_text(i, "alpha", a) for i, a in enumerate(asked)]
    # the same question again, and without the user turn's header
    replies.append(rag.ask_text(4, "alpha", asked[2]))
    rag.send(5, doc="alpha", question_tokens=qs[2][h:], max_tokens=NEW)
    replies.append(rag.reply(5))
    report = rag.close()

    # 0: the file's header; 1: the first's spare (the header: no question before it);
    # 2: the second's, cut after what the first two shared; 3: the third's shares only
    # the header with it, cut back; 4: the fourth's shares the header with 3 ("Who"
    # is not "What"); 5: no header, after the system turn
    want = [h, h, shared, h, h, 0]
    sent = qs + [qs[2], qs[2][h:]]
    assert [r["question_cached"] for r in replies] == want
    assert [r["computed"] for r in replies] == [
        len(q) - c + NEW - 1 for q, c in zip(sent, want)]
    assert all(r["hit"] for r in replies[1:]) and not replies[0]["hit"]
    assert report["spare_forks"] == 5 and report["removed"] == 0
    # an answer from a spare is the answer from the whole prompt
    with lip.kv_create() as kv:
        out = lip.generate(kv, rag_popular.prompt(DOCS["alpha"], asked[2])[0] + qs[2],
                           max_tokens=NEW, ignore_eos=True)
    assert replies[2]["tokens"] == replies[4]["tokens"] == list(out)
    assert int(os.getxattr(kvfs.path("rag", "alpha.kv"), "user.kv.tokens")) == \
        tokens["alpha"] + h


@pytest.mark.slow
def test_no_cache_prefills_every_request(kvfs, lip, tmp_path, rag_popular):
    tokens, q, _, _ = sizes(rag_popular, lip)
    rag = Lip(tmp_path, kvfs, "--no-cache")
    replies = [rag.ask(i, "alpha") for i in range(2)]
    report = rag.close()
    for r in replies:
        assert (r["hit"], r["doc_computed"]) == (False, tokens["alpha"])
        assert r["computed"] == tokens["alpha"] + q + NEW - 1
    assert replies[0]["tokens"] == replies[1]["tokens"]
    assert not os.path.exists(kvfs.path("rag"))
    assert report["files"] == [] and report["misses"] == 0
