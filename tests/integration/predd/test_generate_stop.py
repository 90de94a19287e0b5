"""`stop` has one meaning in liblip and on the wire: None = the model's EOS ids,
a list = exactly those ids and strings ([] = never stop early)."""
import pytest

pytestmark = pytest.mark.slow        # full-length generates


def _chat_prompt(lip) -> list[int]:
    text = lip.client().call("chat_template", messages=[
        {"role": "user", "content": "Say hello."}])["text"]
    return lip.tokenize(text)


def test_stop_none_is_eos_and_empty_list_is_none(lip):
    eos = set(lip.info()["eos_ids"])
    prompt = _chat_prompt(lip)
    with lip.kv_create() as kv:
        by_eos = lip.generate(kv, prompt, max_tokens=64)
    assert by_eos.finish_reason == "stop"
    assert by_eos[-1] in eos and len(by_eos) < 64
    with lip.kv_create() as kv:
        never = lip.generate(kv, prompt, max_tokens=64, stop=[])
    assert never.finish_reason == "length" and len(never) == 64
    assert never[:len(by_eos)] == list(by_eos)       # same greedy path, past the EOS
    with lip.kv_create() as kv:
        streamed = list(lip.generate_stream(kv, prompt, max_tokens=64, stop=[]))
    assert streamed == list(never)


def test_stop_text_alone_does_not_add_eos(lip):
    prompt = _chat_prompt(lip)
    with lip.kv_create() as kv:
        full = lip.generate(kv, prompt, max_tokens=64, stop=[])
    word = lip.detokenize(full[1:2]).strip()
    assert word, "the reply's second token is a word"
    with lip.kv_create() as kv:
        cut = lip.generate(kv, prompt, max_tokens=64, stop=[word])
    assert cut.finish_reason == "stop" and list(cut) == list(full[:len(cut)])
    assert word in lip.detokenize(list(cut)) and len(cut) < len(full)
