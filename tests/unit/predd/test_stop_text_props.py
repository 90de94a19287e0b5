"""Stop strings are matched in a bounded tail of the output (never the whole
output decoded again for every token). The tail finds exactly what a full decode finds,
token for token, and costs a bounded number of decoded ids per token."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from predd.engine.calls import Call
from tests.unit.engine_fakes import Harness


def byte_decode(ids: list[int]) -> str:
    """A byte-level decoder, as GPT-2-style BPE has: an id is one byte; a character
    may take up to four, and a cut one reads as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def first_stop(generated: list[int], stop_text: tuple[str, ...], use_window: bool) -> int | None:
    """The number of tokens after which generation stops, or None."""
    st_ = Call(0, 0, 1, generating=True, stop_text=stop_text)
    for k in range(1, len(generated) + 1):
        st_.generated = generated[:k]
        if use_window:
            hit = st_.hits_stop_text(byte_decode)
        else:
            hit = any(t in byte_decode(generated[:k]) for t in stop_text)
        if hit:
            return k
    return None


text = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=30)


@settings(max_examples=400, deadline=None)
@given(text, st.lists(st.integers(0, 255), max_size=20), st.data())
def test_the_window_stops_exactly_where_a_full_decode_stops(body, noise, data):
    raw = list(body.encode()) + noise
    # Stop strings: often a piece of the output (so they hit), sometimes anything.
    pieces = []
    for _ in range(data.draw(st.integers(1, 3))):
        if body and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(body) - 1))
            pieces.append(body[i:data.draw(st.integers(i + 1, len(body)))])
        else:
            pieces.append(data.draw(text.filter(bool)))
    stop_text = tuple(pieces)
    assert first_stop(raw, stop_text, True) == first_stop(raw, stop_text, False)


def test_multibyte_stop_string_split_over_byte_tokens():
    raw = list("abc→déf".encode())
    assert first_stop(raw, ("→d",), True) == first_stop(raw, ("→d",), False) == 7


def test_decoding_cost_per_token_is_bounded():
    """A long generate with a stop string that never matches decodes at most
    `stop_window` ids per token (it was the whole output, every token)."""
    h = Harness(kv_pages=128)
    kv = h.ok(b"a", "kv_create")["cap"]
    out = h.ok(b"a", "generate", cap=kv, tokens=[1], max_tokens=200, stop=[], stream=False,
               stop_text=["0123"])          # digits never come out of the fake decoder
    assert out["generated"] == 200
    window = 4 * 4 + 8
    assert h.tokenizer.decoded <= 200 * window                  # 4,800; the whole: 20,100
    assert h.tokenizer.decoded == sum(min(k, window) for k in range(1, 201))


def test_a_stop_string_in_a_generate_stops_it_where_it_appears():
    h = Harness(kv_pages=128)
    kv = h.ok(b"a", "kv_create")["cap"]
    free = h.ok(b"a", "generate", cap=kv, tokens=[1], max_tokens=40, stop=[],
                stream=False)["tokens"]
    text = h.tokenizer.decode(free)
    target = text[25:28]
    expect = next(k for k in range(1, 41) if target in h.tokenizer.decode(free[:k]))
    kv2 = h.ok(b"a", "kv_create")["cap"]
    out = h.ok(b"a", "generate", cap=kv2, tokens=[1], max_tokens=40, stop=[], stream=False,
               stop_text=[target])
    assert (out["finish_reason"], out["tokens"]) == ("stop", free[:expect])
