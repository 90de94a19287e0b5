"""How the OpenAI LIP decodes one choice, with liblip calls only.

* `decode_generate`: predd's own loop (sampling, EOS and stop strings inside predd),
  one `generate` call a choice, its tokens handled on the thread that reads predd's
  replies (`lip.generate_into`: no hand-off between threads a token). A cancelled
  request, or a stop string seen here first, stops it: predd cancels the generate
  after its current step.
* `decode_pred`: one `pred` per token, for what predd's loop cannot do: the top
  alternatives' logprobs (raw logits come back and the program samples) and JSON
  schemas (an llguidance mask goes with each call, as mount_examples/constrained_json.py
  does, over the vocabulary of vocab.py; the tokens the grammar forces are appended
  without sampling).
A Choice collects the ids (a final EOS included), each shown token's logprob entry,
the text (stop strings cut out) and the finish reason.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

import liblip as lip
from liblip.threads import run_threads
from openai_lip.requests import RequestError
from openai_lip.room import ROOM_ERRORS
from openai_lip.vocab import PreddTokenizer, default_model, gguf_vocab, tokenizer_vocab



def eos_ids() -> set[int]:
    return set(lip.info_cached()["eos_ids"])


class Cancelled(Exception):
    """The client went away; the request stops at its next call."""


class Request:
    """One request: whether it was cancelled, and the caches it holds (all freed when
    it ends, or at once on cancel — predd frees them after their running call)."""

    def __init__(self, rid, room=None, places: int = 1) -> None:
        self.rid = rid
        self.room = room                    # openai_lip.room.Room, or None
        self.places = places                # held in the room once started: one a part
        self.idle = places - 1              # of those, for parts not started yet
        self.cancelled = threading.Event()  # the client cancelled it
        self.halted = threading.Event()     # cancelled, or one of its threads failed
        self.failure: BaseException | None = None   # ... that thread's error
        self.kvs: list[lip.KV] = []
        # a finished choice's cache kept for the prefix cache file: the first thing given
        # back when another call of the request finds no room
        self.spare: lip.KV | None = None
        self.lock = threading.Lock()

    def no_room(self, exc: lip.LipError, kv: lip.KV) -> lip.KV:
        """The cache to try again on after `exc` refused a call on `kv` (its tokens the
        same; openai_lip/room.py); raises `exc` when that is all, Cancelled when another
        thread of the request failed."""
        if self.halted.is_set() and not self.cancelled.is_set():
            raise Cancelled()
        spare = None
        if exc.code in ROOM_ERRORS:
            with self.lock:
                spare, self.spare = self.spare, None
        if spare is not None:
            self.give_back(spare)
            return kv
        if self.room is None:
            raise exc
        return self.room.no_room(exc, kv, self.give_back, self._rebuild, self.halted)

    def cancel(self) -> None:
        self.cancelled.set()
        self.halted.set()
        if self.room is not None:
            self.room.wake()        # a thread of it parked or waiting for room stops

    def fail(self, exc: BaseException) -> None:
        """One of the request's threads failed with `exc`: the others halt at their next
        call; the first such error is the request's (`failure`), not the ones halting
        causes."""
        with self.lock:
            if not self.halted.is_set():
                self.failure = exc
                self.halted.set()

    def use(self, places: int) -> None:
        """`places` more parts of the request start: they use places it holds idle."""
        with self.lock:
            places = min(places, self.idle)
            self.idle -= places
        if places and self.room is not None:
            self.room.use(places)

    def release(self, places: int) -> None:
        """Give `places` of the request's places in the room back: one a part of it that
        held memory as it ends; all that are left (idle ones too) when the request
        ends."""
        with self.lock:
            places = min(places, self.places)
            self.places -= places
            idle = max(self.idle - self.places, 0)     # the used ones go first
            self.idle -= idle
        if places and self.room is not None:
            self.room.end(places, idle)

    def give_back(self, kv: lip.KV) -> None:
        """Close `kv`, a cache of this request's, now (not when the request ends)."""
        with self.lock:
            if kv in self.kvs:
                self.kvs.remove(kv)
        try:
            lip.kv_close(kv)
        except lip.LipError:
            pass

    def _rebuild(self, tokens: list[int]) -> lip.KV:
        kv = self.track(lip.kv_create())
        while True:
            have = lip.kv_stat(kv)["tokens"]
            try:
                if tokens[have:]:
                    lip.prefill(kv, tokens[have:])
                return kv
            except lip.LipError as exc:
                kv = self.no_room(exc, kv)

    def retrying(self, kv: lip.KV, call):
        """call(kv), tried again while there is no room: (its result, the cache)."""
        while True:
            try:
                return call(kv), kv
            except lip.LipError as exc:
                kv = self.no_room(exc, kv)

    def track(self, kv: lip.KV) -> lip.KV:
        with self.lock:
            self.kvs.append(kv)
        if self.halted.is_set():
            self.free()
        return kv

    def check(self) -> None:
        if self.halted.is_set():
            raise Cancelled()

    def free(self) -> None:
        with self.lock:
            kvs, self.kvs = self.kvs, []
        for kv in kvs:
            try:
                lip.kv_close(kv)
            except lip.LipError:
                pass


def text_decoder():
    """ids -> text, special tokens left out: with predd's tokenizer held here where there
    is one (`lip.tokenizer`, without `lip.decode`'s checks: the ids are predd's own),
    else `lip.decode`."""
    backend = lip.tokenizer()
    if backend is None:
        return lambda ids: lip.decode(ids, skip_special=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


class TextOut:
    """A choice's text as its tokens come: stop strings cut it (and are left out), and
    text that might begin a stop string or end mid-character is held back. With
    `min_tokens`, as vLLM does, no stop string counts before that many tokens: only one
    that ends after their text.

    The text grows a token at a time: the tokens from `_prefix` on are decoded, and
    what the ones before `_read` gave is cut off its front (a window of a few tokens,
    not the whole output: a token costs the same at the 2,000th as at the first). A window whose front is not that text (a decoder that
    joins tokens across it) is decoded whole instead; `full` always is."""

    def __init__(self, stops: list[str], min_tokens: int = 0) -> None:
        self.stops = stops
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self._early = 0 if min_tokens == 0 else None    # chars of the first min_tokens
        self._eos = eos_ids()
        self._decode = text_decoder()
        self._shown: list[int] = []     # the ids that make text (not EOS)
        self._done = ""                 # the text of _shown[:_read]
        self._prefix = self._read = 0
        self._searched = 0              # text before this holds no stop string's end
        self._blanks: dict[int, bool] = {}   # tokens whose text alone is empty

    def _grow(self) -> str:
        """The text of every token so far (a last character may still be partial)."""
        shown = self._shown
        if self._read == len(shown):
            return self._done
        head = self._decode(shown[self._prefix:self._read])
        window = self._decode(shown[self._prefix:])
        if not window.startswith(head):
            window, head = self._decode(shown), self._done
            if not window.startswith(head):      # earlier text changed: start again
                self._done, self._prefix, self._read, self._searched = "", 0, 0, 0
                return window
        if window.endswith("\ufffd"):          # a character's bytes still to come
            return self._done + window[len(head):]
        self._done += window[len(head):]
        # the next window starts at the first new token, or before it where that token
        # has no text of its own (a special left out): a window must begin with text,
        # or a decoder that strips the text's first space strips the next token's
        prefix = self._read
        while prefix > 0 and self._blank(shown[prefix]):
            prefix -= 1
        self._prefix, self._read = prefix, len(shown)
        return self._done

    def _blank(self, token: int) -> bool:
        blank = self._blanks.get(token)
        if blank is None:
            blank = self._blanks[token] = self._decode([token]) == ""
        return blank

    def _early_chars(self) -> int | None:
        """Where a stop string may end after (the first min_tokens' text), once known."""
        if self._early is None and len(self.ids) >= self.min_tokens:
            self._early = len(self._decode(
                [t for t in self.ids[:self.min_tokens] if t not in self._eos]))
        return self._early

    def _cut(self, text: str, searched: int = 0) -> int | None:
        """Where the first stop string in `text` begins (None: none), looking only at
        those that end past `searched` and the first min_tokens' text."""
        early = self._early_chars()
        if early is None:
            return None
        cuts = [at for s in self.stops
                if (at := text.find(s, max(0, early - len(s) + 1, searched - len(s) + 1)))
                >= 0]
        return min(cuts) if cuts else None

    def _text(self) -> tuple[str, bool]:
        text = self._grow()
        cut = self._cut(text, self._searched)
        if cut is not None:
            return text[:cut], True
        if self._early is not None:
            self._searched = len(self._done)    # (a partial last character may change)
        return text, False

    def add(self, ids: list[int]) -> str:
        """Take tokens without looking at the text (nobody is watching it)."""
        self.ids += ids
        self._shown += [t for t in ids if t not in self._eos]
        return ""

    def feed(self, ids: list[int]) -> str:
        """Take tokens; the text that is safe to show now."""
        self.add(ids)
        text, self.stopped = self._text()
        if not self.stopped:
            text = text[:len(text) - self._hold(text)]
            while text.endswith("\ufffd"):
                text = text[:-1]
        return self._advance(text)

    def _hold(self, text: str) -> int:
        """How many characters at the end of `text` may begin a stop string: the
        longest end of it that one begins with (only ends whose last character is the
        stop string's at that length are compared)."""
        if not text:
            return 0
        last, hold = text[-1], 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if s[k - 1] == last and text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def finish(self) -> str:
        """The text not shown yet, once the choice is over."""
        return self._advance(self.full())

    def full(self) -> str:
        """The whole text, decoded at once, up to its first stop string."""
        text = self._decode(self._shown)
        cut = self._cut(text)
        return text if cut is None else text[:cut]

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class Grammar:
    """llguidance over the served model's vocabulary. Reading the vocabulary from the
    GGUF file takes seconds, so `preload` starts it in the background at start-up."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self.tok = None
        self.lock = threading.Lock()

    def preload(self) -> None:
        def load() -> None:
            try:
                self._tokenizer()
            except RequestError:
                pass                        # said again to the first request that needs it
        threading.Thread(target=load, daemon=True).start()

    def _tokenizer(self):
        with self.lock:
            if self.tok is None:
                self.tok = self._load()
            return self.tok

    def matcher(self, schema: dict):
        import llguidance
        self._tokenizer()
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
        try:
            held = lip.tokenizer()
            path = "predd's tokenizer" if held is not None else self.model or default_model()
            tokens = tokenizer_vocab(held) if held is not None else gguf_vocab(path)
        except Exception as exc:   # noqa: BLE001
            raise RequestError(400, "response_format needs the served model's vocabulary "
                               f"({exc})", "response_format") from None
        if len(tokens) != lip.info_cached()["vocab_size"]:
            raise RequestError(400, f"{path}: vocabulary size differs from the served "
                               "model's", "response_format")
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(PreddTokenizer(tokens)),
                                      eos_token=sorted(eos_ids()))


class Choice:
    """One branch's output: ids (EOS included), logprob entries, text, finish reason."""

    def __init__(self, index: int, stops: list[str], min_tokens: int = 0) -> None:
        self.index = index
        self.ids: list[int] = []
        self.entries: list[tuple[int, float, list]] = []   # (id, logprob, [(id, lp)])
        self.out = TextOut(stops, min_tokens)
        self.finish_reason = "length"
        self.text_offset = 0               # completions logprobs: where the next token starts
        self.queue_ms = self.step_ms = 0.0
        self.kv: lip.KV | None = None      # the cache it ended on (after any rebuild)

    def add_cost(self, cost: dict) -> None:
        self.queue_ms += cost.get("queue_ms", 0.0)
        self.step_ms += cost.get("step_ms", 0.0)


def run_parts(req: Request, work: Callable[[int], object], count: int) -> None:
    """work(i) for i < count, one thread each (`run_threads`): a batch's prompts, a
    prompt's choices. Each part holds memory of its own: each has a place of the request's
    in the room (taken when it started: `Request.places`), given back as the part ends,
    but the last one's, which is the request's own (or, for a prompt's choices, the
    prompt's). The first part to fail halts the others at their next call, and its error
    is the one raised."""
    if count == 1:
        work(0)
        return
    req.use(count - 1)
    lock, left = threading.Lock(), [count]

    def part(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            if not isinstance(exc, Cancelled):
                req.fail(exc)
            raise
        finally:
            with lock:
                left[0] -= 1
                last = not left[0]
            if not last:
                req.release(1)
    try:
        run_threads(part, count)
    except BaseException:
        if req.failure is not None and not req.cancelled.is_set():
            raise req.failure from None
        raise


def without_eos() -> bytes:
    """A pred mask (bits, least significant first) allowing every token but EOS."""
    allowed = np.ones(lip.info_cached()["vocab_size"], dtype=bool)
    allowed[sorted(eos_ids())] = False
    return np.packbits(allowed, bitorder="little").tobytes()


def decode_generate(req: Request, kv: lip.KV, last: int, ch: Choice, max_tokens: int,
                    sample: dict, stops: list[str], emit=None, ignore_eos: bool = False,
                    min_tokens: int = 0, pending: Sequence[int] = ()) -> None:
    """predd's own loop (sampling, EOS and stop strings inside predd), in one call: a
    cancelled request (or a stop string seen here first) leaves the stream, which
    cancels the generate in predd after its current step. `pending`: the prompt's tokens
    before `last` not yet in the cache, computed by the first call with `last` (so the
    step that finishes the prompt picks the first token, as vLLM's does). `ignore_eos`:
    EOS ends nothing (it is sampled like any token and left out of the text);
    `min_tokens`: the first that many tokens are sampled with EOS masked out, one
    `pred_sample` each, as vLLM masks it. A generate that predd stops for want of room
    (openai_lip/room.py) goes on from its last token once there is room; a seeded one
    with the seed moved on by the tokens so far."""
    ch.kv = kv
    pending = list(pending)
    if min_tokens and not ignore_eos:
        last = _without_eos(req, last, ch, min(min_tokens, max_tokens), sample, emit,
                            pending)
        if last is None:
            return
        pending = []
    eos = eos_ids()
    stop = [*stops] if ignore_eos else [*eos, *stops]
    while True:
        budget = max_tokens - len(ch.ids)
        if budget <= 0:
            ch.finish_reason = "length"
            return
        seed = sample.get("seed")
        fields = sample if seed is None else {**sample, "seed": (seed + len(ch.ids)) % 2**63}
        out = lip.Generated()
        refused = None
        produced = 0

        def on_tokens(ids: list[int], logprobs: list[float]) -> bool:
            """A chunk's tokens, on the thread that reads predd's replies."""
            nonlocal produced
            if req.halted.is_set():
                return False
            for k, token in enumerate(ids):
                produced += 1
                lp = logprobs[k] if k < len(logprobs) else 0.0
                ch.ids.append(token)
                entries = [] if token in eos else [(token, lp, [])]
                ch.entries += entries
                text = ch.out.feed([token]) if emit or stops else ch.out.add([token])
                if emit:
                    emit(text, entries)
                if ch.out.stopped:   # seen here at the same token as predd, or first
                    return False
            return True

        try:
            if lip.tokenizer() is not None:
                lip.generate_into(ch.kv, [*pending, last], on_tokens, budget, stop=stop,
                                  sample=fields, out=out)
            else:   # text by predd's detokenize: never on the thread that reads its replies
                _stream_to(on_tokens, lip.generate_stream(ch.kv, [*pending, last], budget,
                                                          stop=stop, sample=fields, out=out),
                           out)
        except lip.LipError as exc:
            refused = exc
        req.check()
        ch.add_cost(out.cost)
        if produced:             # the first token came: the prompt is in the cache
            pending = []
        if ch.out.stopped:
            ch.finish_reason = "stop"
            return
        reason = out.finish_reason if refused is None else refused.code
        if not reason and out:   # a predd whose last token reply ends the stream
            reason = "stop" if out[-1] in eos and not ignore_eos else \
                "length" if len(out) >= budget else ""
        if reason in ("stop", "length"):
            ch.finish_reason = reason
            return
        if produced:
            last = ch.ids[-1]       # the cache holds all the others
        ch.kv = req.no_room(refused or lip.LipError(reason or "EIO", "generation failed"),
                            ch.kv)


def _stream_to(on_tokens, stream, out: lip.Generated) -> None:
    """`on_tokens` for each token of a `generate_stream` (with its logprob, from `out`),
    on this thread, until it returns False; the stream closed (predd cancels the rest)."""
    try:
        for i, token in enumerate(stream):
            if on_tokens([token], out.logprobs[i:i + 1] or [0.0]) is False:
                break
    finally:
        stream.close()


def _without_eos(req: Request, last: int, ch: Choice, count: int, sample: dict,
                 emit, pending: list[int]) -> int | None:
    """`count` tokens sampled with EOS masked out (the first call computing `pending`
    too); the last one (to feed on), or None where a stop string ended the choice."""
    rng = np.random.default_rng(sample["seed"])
    mask = without_eos()
    for i in range(count):
        fields = {**sample, "seed": int(rng.integers(2**31))}
        tokens = [*pending, last] if i == 0 else [last]
        s, ch.kv = req.retrying(ch.kv, lambda kv: lip.pred_sample(kv, tokens, fields,
                                                                   mask=mask))
        req.check()
        ch.add_cost(s.cost)
        last = s.token
        ch.ids.append(last)
        entries = [(last, s.logprob, [])]
        ch.entries += entries
        text = ch.out.feed([last]) if emit or ch.out.stops else ch.out.add([last])
        if emit:
            emit(text, entries)
        if ch.out.stopped:
            ch.finish_reason = "stop"
            return None
    return last



def decode_pred(req: Request, kv: lip.KV, last: int, ch: Choice, max_tokens: int,
                sample: dict, top: int, matcher=None, emit=None, ignore_eos: bool = False,
                min_tokens: int = 0) -> None:
    """A pred per token: predd samples under the grammar's mask, or, for top
    logprobs, returns the raw (masked) logits and the program samples. EOS is masked
    out of the first `min_tokens` tokens, and ends nothing with `ignore_eos`."""
    ch.kv = kv
    rng = np.random.default_rng(sample["seed"])
    nbytes = (lip.info_cached()["vocab_size"] + 7) // 8
    no_eos = np.frombuffer(without_eos(), np.uint8) if min_tokens and not ignore_eos else None
    pending = [last]
    while len(ch.ids) < max_tokens:
        mask = matcher.compute_bitmask()[:nbytes] if matcher else None
        if no_eos is not None and len(ch.ids) < min_tokens:
            mask = (no_eos if mask is None else
                    np.frombuffer(bytes(mask), np.uint8) & no_eos).tobytes()
        if top:
            d, ch.kv = req.retrying(ch.kv, lambda kv: lip.pred(kv, pending, mask=mask))
            token = d.argmax() if sample["temperature"] < 1e-4 else d.sample(
                sample["temperature"], sample["top_p"], rng=rng)
            lps = d.logprobs()
            ids, top_lps = d.topk(top)
            lp, alts = float(lps[token]), list(zip(ids, top_lps))
            cost = d.cost
        else:
            fields = {**sample, "seed": int(rng.integers(2**31))}
            s, ch.kv = req.retrying(ch.kv, lambda kv: lip.pred_sample(kv, pending, fields,
                                                                       mask=mask))
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
        if (token in eos_ids() and not ignore_eos) or ch.out.stopped \
                or (matcher and matcher.is_stopped()):
            ch.finish_reason = "stop"
            return
        pending = new
