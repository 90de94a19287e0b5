"""`lip.decode` and `lip.encode`: predd's own tokenizer held in the program gives
`detokenize`'s text and `tokenize`'s ids exactly, with no round trip a call; and predd's
checks of the ids hold."""
import random

import pytest


def test_decode_gives_detokenizes_text_for_every_kind_of_sequence(lip):
    special = lip.info()["eos_ids"] + [1]                  # <|endoftext|>, <|im_end|>, ...
    text = "Hello wörld — 😀 tabs\t and\nnew lines <|im_start|>user"
    rng = random.Random(5)
    vocab = lip.info()["vocab_size"]
    sequences = [lip.tokenize(text), lip.tokenize(text)[:3] + special + lip.tokenize("x"),
                 [rng.randrange(vocab) for _ in range(300)],
                 lip.tokenize("😀")[:1],                   # half a character: U+FFFD
                 []]
    for ids in sequences:
        for skip in (False, True):
            assert lip.decode(ids, skip) == lip.detokenize(ids, skip)
    before = lip.stats()["requests"]
    lip.decode(sequences[2])
    assert lip.stats()["requests"] == before + 1          # the stats call only


def test_encode_gives_tokenizes_ids_for_every_kind_of_text(lip):
    rng = random.Random(7)
    pieces = ["Hello", " wörld", " — ", "😀", "\t", "\n\n", "  ", "12345", "<|im_start|>",
              "<|im_end|>", "user", "\u00e9t\u00e9", "ﬁ", "\x00", "日本語", "'s", "?!"]
    texts = ["", " ", "Hello wörld — 😀 tabs\t and\nnew lines <|im_start|>user",
             *("".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60)))
               for _ in range(40))]
    for text in texts:
        for special in (False, True):
            assert lip.encode(text, special) == lip.tokenize(text, special), repr(text)
    before = lip.stats()["requests"]
    lip.encode(texts[2] * 50)
    assert lip.stats()["requests"] == before + 1          # the stats call only
    for bad in ((b"bytes",), ("\ud800",), ("x", 1)):     # not text; a lone surrogate
        with pytest.raises(lip.LipError) as err:
            lip.encode(*bad)
        assert err.value.code == "EINVAL"


def test_decode_refuses_ids_outside_the_vocabulary_as_detokenize_does(lip):
    vocab = lip.info()["vocab_size"]
    for bad in ([vocab], [-1]):
        with pytest.raises(lip.LipError) as local:
            lip.decode(bad)
        with pytest.raises(lip.LipError) as remote:
            lip.detokenize(bad)
        assert local.value.code == remote.value.code == "EINVAL"


def test_the_held_tokenizer_gives_the_grammars_byte_table_of_the_gguf(lip):
    """The OpenAI program's vocabulary for llguidance, from predd's tokenizer (no GGUF
    read): every token's bytes as the GGUF's own table has them, specials marked."""
    from openai_lip.vocab import default_model, gguf_vocab, tokenizer_vocab
    table = tokenizer_vocab(lip.tokenizer())
    assert len(table) == lip.info()["vocab_size"]
    assert table == gguf_vocab(default_model())
    assert sum(t.startswith(b"\xff") for t in table) == 17


@pytest.mark.parametrize("held", [True, False])
def test_the_openai_programs_generate_gives_the_same_text_with_or_without_a_held_tokenizer(
        lip, monkeypatch, held):
    """decode_generate handles a stream's tokens on the reading thread where the
    tokenizer is held here, and on its own thread where text comes from predd's
    detokenize (a call from the reading thread would wait on itself: EDEADLK). Either
    way: generate's tokens, the whole text, and a stop string cut where it begins."""
    from openai_lip import decode as dm
    if not held:
        monkeypatch.setattr(dm.lip, "tokenizer", lambda: None)
    prompt = lip.tokenize("The capital of France is")
    want = list(lip.generate(lip.kv_create(), prompt, max_tokens=24, stop=[]))
    req = dm.Request(1)
    shown: list[str] = []
    ch = dm.Choice(0, [])
    dm.decode_generate(req, lip.kv_create(), prompt[-1], ch, 24, {"temperature": 0.0}, [],
                       lambda text, entries: shown.append(text), ignore_eos=True,
                       pending=prompt[:-1])
    assert ch.ids == want and ch.finish_reason == "length"
    assert "".join(shown) + ch.out.finish() == lip.decode(want, True)
    stop = lip.decode(want[5:7], True)
    cut = dm.Choice(0, [stop])
    dm.decode_generate(req, lip.kv_create(), prompt[-1], cut, 24, {"temperature": 0.0},
                       [stop], lambda text, entries: None, ignore_eos=True,
                       pending=prompt[:-1])
    whole = lip.decode(want, True)
    assert cut.finish_reason == "stop" and cut.out.full() == whole[:whole.find(stop)]


def test_a_call_from_inside_a_stream_into_callback_is_refused(lip):
    errors: list[str] = []

    def on_tokens(ids, logprobs):
        try:
            lip.detokenize(ids)
        except lip.LipError as exc:
            errors.append(exc.code)
        return False
    lip.generate_into(lip.kv_create(), lip.tokenize("Hello"), on_tokens, max_tokens=8)
    assert errors == ["EDEADLK"]
    assert lip.detokenize([1]) is not None            # the client goes on
