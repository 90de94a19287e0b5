"""`lip.decode`: predd's own tokenizer held in the program gives `detokenize`'s text
exactly, with no round trip a call; and predd's checks of the ids hold."""
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
