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
  (prefix_cache.py: MOUNT/openai/SCOPE-HASH.kv), forked and truncated; the rest is
  prefilled once; `usage.prompt_tokens_details.cached_tokens` is what was reused;
* n > 1 forks the prefilled prompt n times (one prefill, n branches, one thread each);
* plain decoding is predd's own loop (`generate_stream`: sampling, EOS, stop strings),
  in calls of GENERATE_CHUNK tokens;
  top_logprobs and response_format need a pred per token: raw logits (to report the
  top alternatives) and/or an llguidance mask (constrained_json.py's method);
* a cancelled request stops at its next call and frees its caches.

    python mount_examples/openai_server.py [--model PATH.gguf] [--cache-files 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid

import numpy as np

import liblip as lip
from common import eos_ids, info
from liblip.protocol import default_mount
from openai_requests import DEFAULT_MAX_TOKENS, Completion, RequestError, parse
from prefix_cache import PrefixCache

MAX_REQUESTS = 64
GENERATE_CHUNK = 16      # tokens per generate call: how far a cancelled request runs on
STATUS_OF = {"EINVAL": 400, "EDQUOT": 429, "EAGAIN": 429, "ENOSPC": 503, "EIO": 503}


class Cancelled(Exception):
    pass


class Replies:
    """stdout, one JSON object per line, whole lines only."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def send(self, obj: dict) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self.lock:
            sys.stdout.write(line)
            sys.stdout.flush()


class Request:
    """One request's caches (freed on cancel, which ends their predd calls)."""

    def __init__(self, rid) -> None:
        self.rid = rid
        self.cancelled = threading.Event()
        self.kvs: list[lip.KV] = []
        self.lock = threading.Lock()

    def track(self, kv: lip.KV) -> lip.KV:
        with self.lock:
            self.kvs.append(kv)
        if self.cancelled.is_set():
            self.free()
        return kv

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled()

    def free(self) -> None:
        with self.lock:
            kvs, self.kvs = self.kvs, []
        for kv in kvs:
            try:
                lip.kv_close(kv)
            except lip.LipError:
                pass


class TextOut:
    """A choice's text as its tokens come: stop strings cut it (and are left out), and
    text that might begin a stop string or end mid-character is held back."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self) -> tuple[str, bool]:
        text = lip.detokenize([t for t in self.ids if t not in eos_ids()], skip_special=True)
        cuts = [text.find(s) for s in self.stops if s in text]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def add(self, ids: list[int]) -> str:
        """Take tokens without looking at the text (nobody is watching it)."""
        self.ids += ids
        return ""

    def feed(self, ids: list[int]) -> str:
        """Take tokens; the text that is safe to show now."""
        self.ids += ids
        text, self.stopped = self._text()
        if not self.stopped:
            hold = max((k for s in self.stops for k in range(1, len(s))
                        if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
            while text.endswith("\ufffd"):
                text = text[:-1]
        return self._advance(text)

    def finish(self) -> str:
        """The text not shown yet, once the choice is over."""
        return self._advance(self._text()[0])

    def full(self) -> str:
        return self._text()[0]

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class Grammar:
    """llguidance over the served model's vocabulary, loaded on first use."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self.tok = None
        self.lock = threading.Lock()

    def matcher(self, schema: dict):
        import llguidance
        with self.lock:
            if self.tok is None:
                self.tok = self._load()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tok)
        except Exception as exc:   # noqa: BLE001 - llguidance's own errors
            error = str(exc)
        if error:
            raise RequestError(400, f"response_format: {error}", "response_format")
        return llguidance.LLMatcher(self.tok, grammar)

    def _load(self):
        import llguidance
        from constrained_json import PreddTokenizer, default_model, gguf_vocab
        try:
            path = self.model or default_model()
            tokens = gguf_vocab(path)
        except (SystemExit, Exception) as exc:   # noqa: BLE001
            raise RequestError(400, "response_format needs the served model's GGUF "
                               f"vocabulary ({exc})", "response_format") from None
        if len(tokens) != info()["vocab_size"]:
            raise RequestError(400, f"{path}: vocabulary size differs from the served "
                               "model's", "response_format")
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(PreddTokenizer(tokens)),
                                      eos_token=sorted(eos_ids()))


class Choice:
    """One branch's output: ids (EOS included), logprob entries, text, finish reason."""

    def __init__(self, index: int, stops: list[str]) -> None:
        self.index = index
        self.ids: list[int] = []
        self.entries: list[tuple[int, float, list]] = []   # (id, logprob, [(id, lp)])
        self.out = TextOut(stops)
        self.finish_reason = "length"
        self.text_offset = 0               # completions logprobs: where the next token starts
        self.queue_ms = self.step_ms = 0.0

    def add_cost(self, cost: dict) -> None:
        self.queue_ms += cost.get("queue_ms", 0.0)
        self.step_ms += cost.get("step_ms", 0.0)


class Server:
    def __init__(self, args, replies: Replies) -> None:
        self.replies = replies
        self.info = info()
        self.model = self.info["model"]
        self.created = int(time.time())
        self.cache = PrefixCache(args.cache_dir or os.path.join(default_mount(), "openai"),
                                 max_files=args.cache_files, min_tokens=self.info["page_size"])
        self.grammar = Grammar(args.model)
        self.requests: dict = {}
        self.lock = threading.Lock()
        self.token_text: dict[int, str] = {}

    # ------------------------------------------------------------ dispatch

    def handle(self, msg: dict) -> None:
        rid, op = msg.get("id"), msg.get("op")
        if op == "cancel":
            with self.lock:
                req = self.requests.get(rid)
            if req is not None:
                req.cancelled.set()
                req.free()
            return
        if op == "models":
            self.replies.send({"id": rid, "status": 200, "body": self.models()})
            self.replies.send({"id": rid, "done": True})
            return
        with self.lock:
            busy = len(self.requests) >= MAX_REQUESTS
            req = None if busy or rid in self.requests else Request(rid)
            if req is not None:
                self.requests[rid] = req
        if req is None:
            self._error(rid, RequestError(429, "too many requests in progress", None, "EAGAIN"))
            return
        threading.Thread(target=self._serve, args=(req, msg), daemon=True).start()

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created,
            "owned_by": "symphony", "max_model_len": self.info["max_position"]}]}

    def _serve(self, req: Request, msg: dict) -> None:
        try:
            c = parse(msg.get("body"), chat=msg.get("op") == "chat", served=self.model)
            self.complete(req, c, str(msg.get("scope") or ""))
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
            print(f"openai_server: request {req.rid}: {exc!r}", file=sys.stderr, flush=True)
            self._error(req.rid, RequestError(500, f"internal error: {exc}", None, "EIO"))
        finally:
            req.free()
            with self.lock:
                self.requests.pop(req.rid, None)

    def _error(self, rid, exc: RequestError) -> None:
        kind = {400: "invalid_request_error", 404: "invalid_request_error",
                429: "rate_limit_error"}.get(exc.status, "server_error")
        self.replies.send({"id": rid, "status": exc.status, "body": {"error": {
            "message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}})
        self.replies.send({"id": rid, "done": True})

    # ------------------------------------------------------------ one request

    def _prompt(self, c: Completion) -> list[int]:
        if c.chat:
            return lip.chat_template(c.messages)
        if isinstance(c.prompt, list):
            if max(c.prompt) >= self.info["vocab_size"]:
                raise RequestError(400, "prompt has a token id outside the vocabulary", "prompt")
            return c.prompt
        tokens = lip.tokenize(c.prompt)
        if not tokens:
            raise RequestError(400, "prompt is empty", "prompt")
        return tokens

    def complete(self, req: Request, c: Completion, scope: str) -> None:
        started = time.monotonic()
        prompt = self._prompt(c)
        room = self.info["max_position"] - len(prompt)
        if room < 1 or (c.max_tokens or 0) > room:
            raise RequestError(400, f"the prompt ({len(prompt)} tokens) and max_tokens exceed "
                               f"the model's context ({self.info['max_position']})",
                               "max_tokens", "context_length_exceeded")
        max_tokens = c.max_tokens or min(DEFAULT_MAX_TOKENS, room)
        matchers = [self.grammar.matcher(c.schema) for _ in range(c.n)] if c.schema else None
        cid = ("chatcmpl-" if c.chat else "cmpl-") + uuid.uuid4().hex[:24]
        choices = [Choice(i, c.stop) for i in range(c.n)]
        if c.stream:
            self.replies.send({"id": req.rid, "status": 200, "stream": True})
            if c.chat:
                for ch in choices:
                    self._chunk(req, c, cid, ch, {"role": "assistant", "content": ""}, [])
            elif c.echo:
                text = lip.detokenize(prompt)
                for ch in choices:
                    self._chunk(req, c, cid, ch, text, [])

        base, cached = self.cache.lookup(scope, prompt[:-1])
        req.track(base)
        prefill_cost = lip.prefill(base, prompt[cached:-1]) if prompt[cached:-1] else {}
        req.check()
        kvs = [base] if c.n == 1 else [req.track(lip.kv_fork(base)) for _ in range(c.n)]

        def branch(i: int) -> None:
            ch = choices[i]
            emit = (lambda text, entries: self._chunk(req, c, cid, ch, text, entries)) \
                if c.stream else None
            sample = {**c.sample, "seed": None if c.seed is None else (c.seed + i) % 2**63}
            if matchers or c.top_logprobs:
                self._decode_pred(req, kvs[i], prompt[-1], ch, max_tokens, sample,
                                  c.top_logprobs, matchers[i] if matchers else None, emit)
            else:
                self._decode_generate(req, kvs[i], prompt[-1], ch, max_tokens, sample,
                                      c.stop, emit)

        errors: list[BaseException] = []

        def guarded(i: int) -> None:
            try:
                branch(i)
            except BaseException as exc:   # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(c.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        req.check()
        self.cache.store(scope, kvs[0], lip.kv_tokens(kvs[0]))

        completion = sum(len(ch.ids) for ch in choices)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": completion,
                 "total_tokens": len(prompt) + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        cost = {"queue_ms": prefill_cost.get("queue_ms", 0.0) + max(ch.queue_ms for ch in choices),
                "step_ms": prefill_cost.get("step_ms", 0.0) + max(ch.step_ms for ch in choices),
                "prefill_computed": prefill_cost.get("computed", 0),
                "prefill_reused": prefill_cost.get("reused", 0),
                "seconds": round(time.monotonic() - started, 3)}
        if c.stream:
            for ch in choices:
                self._chunk(req, c, cid, ch, ch.out.finish(), [], finish=True)
            if c.include_usage:
                self.replies.send({"id": req.rid, "chunk": {**self._head(c, cid, True),
                                                             "choices": [], "usage": usage}})
        else:
            self.replies.send({"id": req.rid, "status": 200,
                               "body": self._whole(c, cid, prompt, choices, usage)})
        self.replies.send({"id": req.rid, "done": True, "usage": usage, "cost": cost})

    # ------------------------------------------------------------ decoding

    def _decode_generate(self, req, kv, last, ch: Choice, max_tokens, sample, stops, emit):
        """predd's own loop (sampling, EOS and stop strings inside predd), GENERATE_CHUNK
        tokens per call: predd cannot abort a running generate, so a cancelled request
        stops at the end of its chunk."""
        stop = [*eos_ids(), *stops]
        pending, chunk = [last], 0
        while True:
            budget = min(GENERATE_CHUNK, max_tokens - len(ch.ids))
            seed = None if sample["seed"] is None else (sample["seed"] * 1_000_003 + chunk) % 2**63
            out = lip.Generated()
            for token in lip.generate_stream(kv, pending, budget, stop=stop,
                                             sample={**sample, "seed": seed}, out=out):
                req.check()
                lp = out.logprobs[len(out) - 1] if len(out.logprobs) >= len(out) else 0.0
                ch.ids.append(token)
                entries = [] if token in eos_ids() else [(token, lp, [])]
                ch.entries += entries
                text = ch.out.feed([token]) if emit or stops else ch.out.add([token])
                if emit:
                    emit(text, entries)
                if ch.out.stopped:   # a stop string across two calls: predd cannot see it
                    break
            req.check()
            if ch.out.stopped:
                ch.finish_reason = "stop"
                return
            ch.add_cost(out.cost)
            reason = out.finish_reason
            if not reason and out:   # a predd whose last token reply ends the stream
                reason = "stop" if out[-1] in eos_ids() or ch.out.stopped else \
                    "length" if len(out) >= budget else ""
            if reason not in ("stop", "length"):
                raise lip.LipError(reason or "EIO", "generation failed")
            if reason == "stop":
                ch.finish_reason = "stop"
                return
            if len(ch.ids) >= max_tokens:
                ch.finish_reason = "length"
                return
            pending, chunk = [ch.ids[-1]], chunk + 1

    def _decode_pred(self, req, kv, last, ch: Choice, max_tokens, sample, top, matcher, emit):
        """A pred per token: predd samples under the grammar's mask, or, for top
        logprobs, returns the raw (masked) logits and the program samples."""
        rng = np.random.default_rng(sample["seed"])
        nbytes = (self.info["vocab_size"] + 7) // 8
        pending = [last]
        while len(ch.ids) < max_tokens:
            mask = matcher.compute_bitmask()[:nbytes] if matcher else None
            if top:
                d = lip.pred(kv, pending, mask=mask)
                token = d.argmax() if sample["temperature"] < 1e-4 else d.sample(
                    sample["temperature"], sample["top_p"], rng=rng)
                lps = d.logprobs()
                ids, top_lps = d.topk(top)
                lp, alts = float(lps[token]), list(zip(ids, top_lps))
                cost = d.cost
            else:
                s = lip.pred(kv, pending, mask=mask, sample={
                    **sample, "seed": int(rng.integers(2**31))})
                token, lp, alts, cost = s.token, s.logprob, [], s.cost
            req.check()
            ch.add_cost(cost)
            forced: list[int] = []
            if matcher:
                if not matcher.consume_token(token):
                    raise RuntimeError(f"grammar refused token {token}: {matcher.get_error()}")
                forced = [] if matcher.is_stopped() else matcher.compute_ff_tokens()
                if forced and not matcher.consume_tokens(forced):
                    raise RuntimeError(f"grammar refused forced tokens: {matcher.get_error()}")
            new = [token, *forced][:max_tokens - len(ch.ids)]
            ch.ids += new
            entries = [(t, lp if j == 0 else 0.0, alts if j == 0 else [])
                       for j, t in enumerate(new) if t not in eos_ids()]
            ch.entries += entries
            text = ch.out.feed(new) if emit or ch.out.stops else ch.out.add(new)
            if emit:
                emit(text, entries)
            if token in eos_ids() or ch.out.stopped or (matcher and matcher.is_stopped()):
                ch.finish_reason = "stop"
                return
            pending = new

    # ------------------------------------------------------------ formatting

    def _head(self, c: Completion, cid: str, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if c.chat \
            else "text_completion"
        return {"id": cid, "object": kind, "created": int(time.time()), "model": self.model}

    def _token(self, t: int) -> str:
        if t not in self.token_text:
            self.token_text[t] = lip.detokenize([t])
        return self.token_text[t]

    def _logprobs(self, c: Completion, entries: list, offset: int = 0) -> dict | None:
        if not c.logprobs:
            return None
        if c.chat:
            def one(t, lp):
                s = self._token(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                                for t, lp, alts in entries]}
        tokens = [self._token(t) for t, _, _ in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self._token(a): alp for a, alp in alts}
                                 for _, _, alts in entries], "text_offset": offsets}

    def _chunk(self, req, c: Completion, cid, ch: Choice, text, entries, finish=False):
        """One streamed delta of choice `ch`: text (or, for chat, the opening role delta)
        and the logprobs of the tokens that came with it."""
        if not (finish or text or entries):
            return
        if c.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            choice = {"index": ch.index, "delta": delta,
                      "logprobs": self._logprobs(c, entries)}
        else:
            choice = {"index": ch.index, "text": text,
                      "logprobs": self._logprobs(c, entries, ch.text_offset)}
            ch.text_offset += len(text)
        choice["finish_reason"] = ch.finish_reason if finish else None
        self.replies.send({"id": req.rid, "chunk": {**self._head(c, cid, True),
                                                    "choices": [choice]}})

    def _whole(self, c: Completion, cid, prompt, choices: list[Choice], usage) -> dict:
        out = []
        for ch in choices:
            text = ch.out.full()
            if c.chat:
                out.append({"index": ch.index, "message": {"role": "assistant", "content": text},
                            "logprobs": self._logprobs(c, ch.entries),
                            "finish_reason": ch.finish_reason})
            else:
                head = lip.detokenize(prompt) if c.echo else ""
                out.append({"index": ch.index, "text": head + text,
                            "logprobs": self._logprobs(c, ch.entries, len(head)),
                            "finish_reason": ch.finish_reason})
        return {**self._head(c, cid, False), "choices": out, "usage": usage,
                "system_fingerprint": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the GGUF file predd serves (its vocabulary, for "
                    "response_format)")
    ap.add_argument("--cache-dir", help="where the prefix cache files go "
                    "(default $KVFS_MOUNT/openai)")
    ap.add_argument("--cache-files", type=int, default=16, help="prefix cache files kept")
    args = ap.parse_args()
    os.umask(0o077)                      # cache files are this program's own
    replies = Replies()
    server = Server(args, replies)
    replies.send({"ready": True, "model": server.model})
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict):
            server.handle(msg)


if __name__ == "__main__":
    main()
