"""The OpenAI program's TextOut (openai_lip/decode.py) over SmolLM2's real tokenizer:
the text it grows a token at a time is the whole decode at every token (random ids,
specials, EOS, characters split over tokens), stop strings cut it where the whole text
would be cut, min_tokens' text is never cut, and a token costs a window's decode, not
the output's."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import openai_lip.decode as decode_mod
from openai_lip.decode import TextOut
from predd.model.loader import default_model_path
from predd.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture
def lip(tokenizer, monkeypatch):
    calls: list[int] = []

    class Held:                         # predd's tokenizer as lip.tokenizer() holds it
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens)

    fake = SimpleNamespace(tokenizer=Held, calls=calls,
                           info_cached=lambda: {"eos_ids": tokenizer.eos_ids})
    monkeypatch.setattr(decode_mod, "lip", fake)
    return fake


def whole(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in tokenizer.eos_ids], True)


_PARTIAL: list[int] = []


def pieces(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Random ids, with specials, EOS and tokens that hold part of a character."""
    if not _PARTIAL:
        _PARTIAL.extend(i for i in range(49152) if "\ufffd" in tokenizer.decode([i]))
    assert len(_PARTIAL) > 100
    pool = [*range(1, 17), *tokenizer.eos_ids, *_PARTIAL]
    return [rng.choice(pool) if rng.random() < 0.3 else rng.randrange(17, 49152)
            for _ in range(n)]


def streamed(ids: list[int], stops: list[str]) -> tuple[TextOut, str]:
    """ids fed a token at a time until a stop string: the TextOut, and all it showed."""
    out, shown = TextOut(stops), ""
    for t in ids:
        shown += out.feed([t])
        if out.stopped:
            return out, shown
    return out, shown + out.finish()


def test_grown_text_is_the_whole_decode_at_every_token(tokenizer, lip):
    rng = random.Random(7)
    for _ in range(40):
        ids = pieces(tokenizer, rng, rng.randrange(1, 60))
        out, shown = TextOut([]), ""
        for i, t in enumerate(ids):
            shown += out.feed([t])
            text = whole(tokenizer, ids[:i + 1])
            assert text.startswith(shown) and "\ufffd" not in shown[-1:]
            assert out._text()[0] == text
        shown += out.finish()
        assert shown == whole(tokenizer, ids) == out.full()


def test_stop_strings_cut_where_the_whole_text_would(tokenizer, lip):
    rng = random.Random(11)
    text_ids = tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta")
    for _ in range(30):
        ids = [*pieces(tokenizer, rng, rng.randrange(0, 8)), *text_ids,
               *pieces(tokenizer, rng, 4)]
        stops = [rng.choice(["gamma", "a d", " ze", "theta", "nope"])]
        out, shown = streamed(ids, stops)
        full = whole(tokenizer, ids)
        at = full.find(stops[0])
        assert shown == (full if at < 0 else full[:at]), (stops, full)
        assert out.stopped == (at >= 0 and at + len(stops[0]) <= len(
            whole(tokenizer, out.ids)))


def test_min_tokens_text_is_never_cut(tokenizer, lip):
    ids = tokenizer.encode("stop here and stop there")
    out = TextOut(["stop"], min_tokens=3)
    shown = "".join(out.feed([t]) for t in ids if not out.stopped)
    assert shown == "stop here and "
    assert out.full() == "stop here and "


def test_a_token_decodes_a_window_not_the_output(tokenizer, lip):
    ids = tokenizer.encode("word " * 600)[:600]
    out = TextOut(["\n\n"])
    for t in ids:
        out.feed([t])
    assert out.sent + out.finish() == whole(tokenizer, ids)
    assert max(lip.calls[:-1]) <= 3          # finish decodes the whole once


def test_a_window_never_begins_with_a_token_without_text(monkeypatch):
    """A decoder that strips the text's first space (SentencePiece's Metaspace): a
    special token left out must not begin a window, or the next word loses its space."""
    from tokenizers import Tokenizer, decoders, models
    words = ["\u2581Hello", "\u2581world", "<sp>", "\u2581cat", "<unk>", "</s>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<sp>", "</s>"])
    monkeypatch.setattr(decode_mod, "lip", SimpleNamespace(
        tokenizer=lambda: tok, info_cached=lambda: {"eos_ids": [5]}))
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.choice([0, 1, 2, 3, 2, 5]) for _ in range(rng.randrange(1, 12))]
        _, shown = streamed(ids, ["cat w"])
        text = tok.decode([t for t in ids if t != 5], skip_special_tokens=True)
        at = text.find("cat w")
        assert shown == (text if at < 0 else text[:at]), ids


def test_the_text_held_back_is_the_longest_end_a_stop_string_begins_with(lip):
    rng = random.Random(5)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 7)))
                 for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 9)))
        want = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
                   default=0)
        assert TextOut(stops)._hold(text) == want, (stops, text)
