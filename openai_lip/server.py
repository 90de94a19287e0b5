"""The OpenAI API as a LIP: chat and text completions answered with liblip calls only.

A long-running program that reads requests as JSON lines on stdin and writes replies
as JSON lines on stdout (gatewayd runs it sandboxed and puts HTTP in front of it), one
thread per request:

    in:  {"id": 7, "op": "chat" | "completion" | "models", "body": {...}, "scope": "alice"}
         {"id": 7, "op": "cancel"}
    out: {"id": 7, "status": 200, "body": {...}}             a whole answer or an error
         {"id": 7, "status": 200, "stream": true}            then {"id": 7, "chunk": {...}}...
         {"id": 7, "done": true, "usage": {...}, "cost": {...}}   the last line of each id

How it uses the system calls:
* the prompt's longest cached prefix comes from a cache file it keeps under the mount
  (prefix_cache.py: MOUNT/openai/SCOPE-HASH.kv), forked and truncated; the answer's
  own file is saved after the answer has gone out;
  `usage.prompt_tokens_details.cached_tokens` is what was reused;
* echo with logprobs scores the prompt itself: its tokens computed on a fresh cache, an
  output at each, SCORE_ROWS a call;
* a batch of prompts (completions) runs each prompt as one would, side by side, choice
  i * n + j the jth of prompt i; only the first one's answer goes to the prefix cache;
* n > 1 prefills the rest of the prompt once and forks it n times (n branches, one
  thread each); n = 1 without top_logprobs or response_format leaves it to the first
  call of its decoding (`generate`, or with min_tokens its first `pred_sample`), so the
  step that ends the prompt picks the first token;
* plain decoding is predd's own loop (`generate`), its tokens made into text and
  chunks on the thread that reads predd's replies (`lip.generate_into`), and the lines
  written by a thread of their own; top_logprobs and response_format take a pred per
  token: raw logits and/or an llguidance mask (decode.py);
* a cancelled request stops at its next call and frees its caches;
* 64 requests run at once, the rest wait in a queue; a call predd refuses for room
  waits, or gives its cache back and computes it again, rather than fail (room.py).

    python -m openai_lip [--model PATH.gguf] [--cache-dir DIR] [--cache-files 16]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import liblip as lip
import numpy as np
from openai_lip.decode import (Cancelled, Choice, Grammar, Request, decode_generate,
                               decode_pred, run_parts)
from openai_lip.format import Formatter
from openai_lip.prefix_cache import PrefixCache
from openai_lip.requests import DEFAULT_MAX_TOKENS, Completion, RequestError, parse
from openai_lip.room import Room
from openai_lip.vocab import longest_token_chars
from symphony_protocol import default_mount

MAX_REQUESTS = 64       # requests running at once; more wait in a queue
SPARE_CACHES = 32       # empty caches made ahead (prefix_cache.EmptyCaches)
MAX_QUEUED = 4096       # requests waiting to start; more are a 429
STATUS_OF = {"EINVAL": 400, "E2BIG": 400, "EDQUOT": 429, "EAGAIN": 429, "ENOSPC": 503,
             "EIO": 503}


_encode = json.JSONEncoder(separators=(",", ":")).encode   # one encoder for every line


class Replies:
    """stdout, one JSON object per line, whole lines only, in the order sent. A thread
    of its own writes them: a sender never waits on the reader of stdout (stream chunks
    are made on the thread that reads predd's replies, which must not stall behind a
    full pipe: it also keeps the session's lease), and lines sent together go out in
    one write. Past QUEUED_BYTES not yet taken, a sender waits for room."""

    QUEUED_BYTES = 64 << 20

    def __init__(self, out=None) -> None:
        self.out = sys.stdout if out is None else out
        self.cond = threading.Condition()
        self.lines: list[str] = []
        self.queued = 0
        self.writing = False
        self.thread = threading.Thread(target=self._write, name="openai-replies", daemon=True)
        self.thread.start()

    def send(self, obj: dict) -> None:
        line = _encode(obj) + "\n"
        with self.cond:
            while self.queued >= self.QUEUED_BYTES:
                self.cond.wait()
            self.lines.append(line)
            self.queued += len(line)
            if len(self.lines) == 1:
                self.cond.notify_all()

    def drain(self) -> None:
        """Return once every line sent so far is written."""
        with self.cond:
            self.cond.wait_for(lambda: not self.lines and not self.writing)

    def _write(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.lines)
                lines, self.lines, self.queued = self.lines, [], 0
                self.writing = True
                self.cond.notify_all()
            try:
                self.out.write("".join(lines))
                self.out.flush()
            except (OSError, ValueError):     # stdout gone: the gateway went away
                pass
            with self.cond:
                self.writing = False
                self.cond.notify_all()


SCORE_ROWS = 16          # prompt positions a call when the prompt's logprobs are asked for


@dataclass
class Run:
    """One prompt of a request and its n choices; what its cache lookup and prefill gave,
    and (echo with logprobs) the prompt's own logprob entries."""
    prompt: list[int]
    choices: list[Choice]
    cached: int = 0                 # tokens reused from a prefix cache file
    prefill_cost: dict = field(default_factory=dict)
    scored: list = field(default_factory=list)
    matchers: list | None = None    # response_format: each choice's, compiled up front


class Server:
    def __init__(self, args: argparse.Namespace, replies: Replies) -> None:
        self.replies = replies
        self.info = lip.info_cached()
        self.model = self.info["model"]
        self.created = int(time.time())
        self.cache = PrefixCache(args.cache_dir or os.path.join(default_mount(), "openai"),
                                 max_files=args.cache_files, min_tokens=self.info["page_size"],
                                 spares=SPARE_CACHES)
        self.grammar = Grammar(args.model)
        self.grammar.preload()
        # predd's tokenizer, fetched before any request; a prompt of more characters than
        # any text of the context can have is refused before it is encoded (0: no bound)
        self.max_prompt_chars = self.info["max_position"] * (
            longest_token_chars(lip.tokenizer()) or 0)
        self.format = Formatter(self.model)
        self.requests: dict = {}
        self.lock = threading.Lock()
        self.room = Room(self.cache.drop_all, MAX_REQUESTS, MAX_QUEUED)

    # ------------------------------------------------------------ dispatch

    def handle(self, msg: dict) -> None:
        rid, op = msg.get("id"), msg.get("op")
        if op == "cancel":
            with self.lock:
                req = self.requests.get(rid)
            if req is not None:
                req.cancel()
                req.free()
                if self.room.withdraw(req):          # it had not started
                    with self.lock:
                        self.requests.pop(rid, None)
                    self.replies.send({"id": rid, "done": True, "cancelled": True})
            return
        if op == "models":
            self.replies.send({"id": rid, "status": 200, "body": self.models()})
            self.replies.send({"id": rid, "done": True})
            return
        try:        # checked first: a request's places are its prompts times its choices
            c = parse(msg.get("body"), chat=op == "chat", served=self.model)
        except RequestError as exc:
            self._error(rid, exc)
            return
        except Exception as exc:   # noqa: BLE001 - one request fails, the server goes on
            print(f"openai_lip: request {rid!r}: {exc!r}", file=sys.stderr, flush=True)
            self._error(rid, RequestError(500, f"internal error: {exc}", None, "EIO"))
            return
        with self.lock:
            req = None if rid in self.requests else Request(rid, self.room, c.parts)
            if req is not None:
                self.requests[rid] = req
        if req is None:
            self._error(rid, RequestError(400, "a request with this id is in progress",
                                          None, "EEXIST"))
            return
        scope = str(msg.get("scope") or "")
        start = threading.Thread(target=self._serve, args=(req, c, scope), daemon=True).start
        if not self.room.submit(req, start, scope, c.parts):
            with self.lock:
                self.requests.pop(rid, None)
            self._error(rid, RequestError(429, "too many requests waiting", None, "EAGAIN"))


    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created,
            "owned_by": "symphony", "max_model_len": self.info["max_position"]}]}

    def _serve(self, req: Request, c: Completion, scope: str) -> None:
        try:
            self.complete(req, c, scope)
        except RequestError as exc:
            self._error(req.rid, exc)
        except Cancelled:
            self.replies.send({"id": req.rid, "done": True, "cancelled": True})
        except lip.LipError as exc:
            if req.cancelled.is_set():
                self.replies.send({"id": req.rid, "done": True, "cancelled": True})
            else:
                self._error(req.rid, RequestError(STATUS_OF.get(exc.code, 500), exc.message,
                                                  None, exc.code))
        except Exception as exc:   # noqa: BLE001 - one request fails, the server goes on
            print(f"openai_lip: request {req.rid}: {exc!r}", file=sys.stderr, flush=True)
            self._error(req.rid, RequestError(500, f"internal error: {exc}", None, "EIO"))
        finally:
            req.free()
            with self.lock:
                self.requests.pop(req.rid, None)
            req.release(req.places)

    def _error(self, rid, exc: RequestError) -> None:
        kind = {400: "invalid_request_error", 404: "invalid_request_error",
                429: "rate_limit_error"}.get(exc.status, "server_error")
        self.replies.send({"id": rid, "status": exc.status, "body": {"error": {
            "message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}})
        self.replies.send({"id": rid, "done": True})

    # ------------------------------------------------------------ one request

    def _prompt(self, c: Completion, prompt: str | list[int] = "") -> list[int]:
        """The ids of the chat's conversation, or of one of the completion's prompts; a
        400 for a prompt that is empty, too long for the context, or not of this
        vocabulary."""
        if c.chat:
            ids = lip.chat_template(c.messages)
        elif isinstance(prompt, list):
            if max(prompt) >= self.info["vocab_size"]:
                raise RequestError(400, "prompt has a token id outside the vocabulary", "prompt")
            ids = prompt
        else:
            if self.max_prompt_chars and len(prompt) > self.max_prompt_chars:
                raise RequestError(400, f"the prompt ({len(prompt)} characters) is longer "
                                   f"than any text of the model's context "
                                   f"({self.info['max_position']} tokens) can be", "prompt",
                                   "context_length_exceeded")
            ids = lip.encode(prompt)      # here, not a round trip to predd a prompt
            if not ids:
                raise RequestError(400, "prompt is empty", "prompt")
        room = self.info["max_position"] - len(ids)
        if room < 1 or (c.max_tokens or 0) > room:
            raise RequestError(400, f"the prompt ({len(ids)} tokens) and max_tokens exceed "
                               f"the model's context ({self.info['max_position']})",
                               "max_tokens", "context_length_exceeded")
        return ids

    def complete(self, req: Request, c: Completion, scope: str) -> None:
        started = time.monotonic()
        # every prompt checked before anything is sent or computed
        prompts = [self._prompt(c)] if c.chat else [self._prompt(c, p) for p in c.prompts]
        cid = ("chatcmpl-" if c.chat else "cmpl-") + uuid.uuid4().hex[:24]
        runs = [Run(prompt, [Choice(i * c.n + j, c.stop, c.min_tokens) for j in range(c.n)])
                for i, prompt in enumerate(prompts)]
        if c.schema:            # (a schema it cannot compile is a 400, before any header)
            for run in runs:
                run.matchers = [self.grammar.matcher(c.schema) for _ in range(c.n)]
        if c.stream:
            self.replies.send({"id": req.rid, "status": 200, "stream": True})
            for run in [] if c.scores_prompt else runs:     # (else once the prompt is scored)
                opening = {"role": "assistant", "content": ""} if c.chat else \
                    lip.decode(run.prompt) if c.echo else ""
                for ch in run.choices:
                    self._chunk(req, c, cid, ch, opening, [])
        run_parts(req, lambda i: self._decode(req, c, runs[i], cid, scope, keep=not i),
                  len(runs))
        req.check()

        # the reply goes before the prefix cache's file is saved (openai_lip/prefix_cache.py):
        # the first prompt's first choice, as for one prompt (a batch of prompts would
        # otherwise push every other conversation's file out of the cache at once)
        first = runs[0]
        promise = self.cache.promise(scope, first.prompt + first.choices[0].ids[:-1])
        try:
            self._answer(req, c, cid, runs, started)
        finally:
            with req.lock:
                kept, req.spare = req.spare, None
            try:
                if kept is first.choices[0].kv:
                    self.cache.keep(promise, scope, kept)
                else:               # given back for another part's room: no file
                    self.cache.withdraw(promise)
            except Exception as exc:   # noqa: BLE001 - answered already: a cache that
                print(f"openai_lip: prefix cache: {exc!r}",   # cannot grow fails nothing
                      file=sys.stderr, flush=True)

    def _decode(self, req: Request, c: Completion, run: Run, cid: str, scope: str,
                keep: bool) -> None:
        """One prompt's n choices: its longest cached prefix, the rest prefilled (or left
        to the first call of a lone choice's decoding), forked for n > 1, one thread a
        choice. Its caches go back when its choices are done (another prompt's may wait
        for their room), but the first choice's where it is to be kept (`keep`: for the
        prefix cache file)."""
        prompt, choices = run.prompt, run.choices
        max_tokens = c.max_tokens or min(DEFAULT_MAX_TOKENS,
                                         self.info["max_position"] - len(prompt))
        matchers = run.matchers
        if c.scores_prompt:           # every prompt position's output: none from a cache file
            base = req.track(self.cache.fresh())
            base = self._score(req, c, run, base)
            if c.stream:
                for ch in choices:
                    self._chunk(req, c, cid, ch, lip.decode(prompt), run.scored)
        else:
            base, run.cached = self.cache.lookup(scope, prompt[:-1])
            req.track(base)
        rest = [] if c.scores_prompt else prompt[run.cached:-1]   # (scored: all but the last)
        if c.n == 1 and not (matchers or c.top_logprobs or c.scores_prompt):   # one generate
            pending, rest = rest, []
            if pending:
                run.prefill_cost = {"computed": len(pending), "reused": run.cached}
        else:
            pending = []
        while rest:
            try:
                run.prefill_cost = lip.prefill(base, rest)
                break
            except lip.LipError as exc:
                base = req.no_room(exc, base)
                rest = prompt[lip.kv_stat(base)["tokens"]:-1]
        req.check()
        kvs = [base]
        if c.n > 1:             # a fork copies the last page: it too may wait for room
            kvs = []
            for _ in range(c.n):
                fork, base = req.retrying(base, lip.kv_fork)
                kvs.append(req.track(fork))

        def branch(i: int) -> None:
            ch = choices[i]
            emit = (lambda text, entries: self._chunk(req, c, cid, ch, text, entries)) \
                if c.stream else None
            sample = {**c.sample, "seed": None if c.seed is None else (c.seed + i) % 2**63}
            if matchers or c.top_logprobs:
                decode_pred(req, kvs[i], prompt[-1], ch, max_tokens, sample, c.top_logprobs,
                            matchers[i] if matchers else None, emit, c.ignore_eos,
                            c.min_tokens)
            else:
                decode_generate(req, kvs[i], prompt[-1], ch, max_tokens, sample, c.stop, emit,
                                c.ignore_eos, c.min_tokens, pending)
            if c.stream:        # its last chunk as it ends, not when the slowest one does
                self._chunk(req, c, cid, ch, ch.out.finish(), [], finish=True)
            if keep and i == 0:     # for the prefix cache file, unless another needs room
                req.spare = ch.kv
            elif ch.kv is not None:
                req.give_back(ch.kv)

        run_parts(req, branch, c.n)
        if base is not choices[0].kv:
            req.give_back(base)

    def _score(self, req: Request, c: Completion, run: Run, base: lip.KV) -> lip.KV:
        """The prompt's own logprobs (`echo` with `logprobs`), as vLLM gives them: its
        tokens but the last computed into `base`, SCORE_ROWS a call, with the
        distribution after each; entry i the logprob of token i after tokens < i (and
        the `logprobs` most likely, the token's own among them), none for the first.
        The cache to go on with (another where there was no room: room.py)."""
        prompt, entries = run.prompt, [(run.prompt[0], None, None)]
        cost = run.prefill_cost = {"computed": 0, "reused": 0, "queue_ms": 0.0, "step_ms": 0.0}
        while len(entries) < len(prompt):
            have = len(entries) - 1                # tokens in the cache, each scored
            if lip.kv_stat(base)["tokens"] != have:
                raise RuntimeError("the prompt's cache holds other than what was scored")
            chunk = prompt[have:min(have + SCORE_ROWS, len(prompt) - 1)]
            try:
                rows = lip.pred_outputs(base, chunk, list(range(len(chunk))))
            except lip.LipError as exc:
                base = req.no_room(exc, base)
                continue
            req.check()
            for key in ("computed", "queue_ms", "step_ms"):    # (a call's, on each row)
                cost[key] += rows[0].cost.get(key, 0)
            for i, dist in enumerate(rows):
                row = dist.logprobs()
                token = prompt[have + i + 1]       # the prompt token this row predicts
                best = np.argsort(-row, kind="stable")[:c.top_logprobs].tolist()
                alts = [(t, float(row[t])) for t in best + ([token] if token not in best
                                                            else [])]
                entries.append((token, float(row[token]), alts))
        run.scored = entries
        return base

    def _answer(self, req: Request, c: Completion, cid: str, runs: list[Run],
                started: float) -> None:
        choices = [ch for run in runs for ch in run.choices]
        prompt_tokens = sum(len(run.prompt) for run in runs)
        completion = sum(len(ch.ids) for ch in choices)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(run.cached for run in runs)}}
        # the prompts ran side by side: the slowest one's times
        cost = {"queue_ms": max(run.prefill_cost.get("queue_ms", 0.0)
                                + max(ch.queue_ms for ch in run.choices) for run in runs),
                "step_ms": max(run.prefill_cost.get("step_ms", 0.0)
                               + max(ch.step_ms for ch in run.choices) for run in runs),
                "prefill_computed": sum(run.prefill_cost.get("computed", 0) for run in runs),
                "prefill_reused": sum(run.prefill_cost.get("reused", 0) for run in runs),
                "seconds": round(time.monotonic() - started, 3)}
        if c.stream:            # (each choice's last chunk went as it ended)
            if c.include_usage:
                self.replies.send({"id": req.rid, "chunk": {**self.format.head(c, cid, True),
                                                             "choices": [], "usage": usage}})
        else:
            self.replies.send({"id": req.rid, "status": 200, "body": self.format.whole(
                c, cid, [(run.prompt, run.choices, run.scored) for run in runs], usage)})
        self.replies.send({"id": req.rid, "done": True, "usage": usage, "cost": cost})

    def _chunk(self, req: Request, c: Completion, cid: str, ch: Choice, text, entries,
               finish: bool = False) -> None:
        chunk = self.format.chunk(c, cid, ch, text, entries, finish)
        if chunk is not None:
            self.replies.send({"id": req.rid, "chunk": chunk})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m openai_lip",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the GGUF file predd serves (its vocabulary, for "
                    "response_format)")
    ap.add_argument("--cache-dir", help="where the prefix cache files go "
                    "(default $KVFS_MOUNT/openai)")
    ap.add_argument("--cache-files", type=int, default=16, help="prefix cache files kept")
    args = ap.parse_args(argv)
    os.umask(0o077)                      # cache files are this program's own
    replies = Replies()
    server = Server(args, replies)
    # start-up's objects (the vocabulary's tables) out of every later full collection,
    # which otherwise walks them all (~30 ms, stalling every stream) every so often
    gc.collect()
    gc.freeze()
    replies.send({"ready": True, "model": server.model})
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict):
            server.handle(msg)
    replies.drain()
