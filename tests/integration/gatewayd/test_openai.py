"""The OpenAI API of a real `symphony serve`, through the official `openai` package:
answered by the OpenAI LIP (`python -m openai_lip`), checked against predd's
own greedy decoding and predd's counters (one prefill for n > 1, cached prefixes)."""
from __future__ import annotations

import json
import os

import numpy as np
import openai
import pytest

from tests.integration.gateway_fixtures import checked_client, eventually, finish, start_serve

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="symphony serve needs root"),
              pytest.mark.slow]
EOS = {0, 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_serve(str(tmp_path_factory.mktemp("openai")))
    yield s
    finish(s)


@pytest.fixture
def predd(server):
    with checked_client(server) as c:
        yield c


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.fixture
def model(predd):
    return predd.call("info")["model"]


def greedy(predd, tokens: list[int], max_tokens: int) -> tuple[list[int], str]:
    """predd's own greedy decode of `tokens` (a fresh cache): ids and text."""
    kv = predd.call("kv_create")
    try:
        ids = predd.call("generate", cap=kv["cap"], tokens=tokens, max_tokens=max_tokens,
                         stream=False)["tokens"]
    finally:
        predd.call("kv_free", cap=kv["cap"])
    return ids, predd.call("detokenize", tokens=ids, skip_special=True)["text"]


def template(predd, messages) -> list[int]:
    return predd.call("chat_template", messages=messages)["tokens"]


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


QUESTION = [{"role": "system", "content": "You answer in exactly one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_models(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_chat_is_predds_greedy_decode(client, predd, model):
    tokens = template(predd, QUESTION)
    ids, text = greedy(predd, tokens, 8)
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if ids[-1] in EOS else "length")
    assert r.usage.prompt_tokens == len(tokens)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_ignore_eos_goes_on_to_max_tokens(client, predd, model):
    """As vLLM and SGLang honour it (their benchmark clients send it): predd's greedy
    decode past EOS, the EOS ids left out of the text."""
    tokens = template(predd, QUESTION)
    short, _ = greedy(predd, tokens, 24)
    assert short[-1] in EOS and len(short) < 24            # the answer ends by itself
    kv = predd.call("kv_create")
    try:
        ids = predd.call("generate", cap=kv["cap"], tokens=tokens, max_tokens=24, stop=[],
                         stream=False)["tokens"]
    finally:
        predd.call("kv_free", cap=kv["cap"])
    assert len(ids) == 24 and ids[:len(short)] == short
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                           temperature=0, stream=stream,
                                           extra_body={"ignore_eos": True},
                                           **({"stream_options": {"include_usage": True}}
                                              if stream else {}))
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, reason, usage = (r.choices[0].message.content, r.choices[0].finish_reason,
                                   r.usage)
        assert (text, reason, usage.completion_tokens) == (
            predd.call("detokenize", tokens=ids, skip_special=True)["text"], "length", 24)


def test_min_tokens_masks_eos_until_then(client, predd, model):
    tokens = template(predd, QUESTION)
    short, text = greedy(predd, tokens, 24)
    least = len(short) + 3
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40,
                                       temperature=0, extra_body={"min_tokens": least})
    answer = r.choices[0].message.content
    assert r.usage.completion_tokens >= least
    assert answer.startswith(text) and len(answer) > len(text)
    # the same with top logprobs (a pred per token, the program sampling): the same text
    r2 = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40,
                                        temperature=0, logprobs=True, top_logprobs=2,
                                        extra_body={"min_tokens": least})
    assert r2.choices[0].message.content == answer
    assert r2.usage.completion_tokens == r.usage.completion_tokens
    # a stop string within the first min_tokens tokens does not count (as in vLLM)
    early = text[:8]
    assert early and early not in answer[len(text):]
    r3 = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40,
                                        temperature=0, stop=[early],
                                        extra_body={"min_tokens": least})
    assert r3.choices[0].message.content == answer


def test_streamed_chat_reuses_the_cached_conversation(client, predd, model):
    tokens = template(predd, QUESTION)
    ids, text = greedy(predd, tokens, 8)
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish_reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert "".join(parts) == text
    assert finish_reasons == ["stop" if ids[-1] in EOS else "length"]
    assert usage.completion_tokens == len(ids)
    # the same prompt again: all of it but the last token comes from the cache file
    assert usage.prompt_tokens_details.cached_tokens == len(tokens) - 1


def test_a_stream_is_written_as_openai_writes_it(server, predd, model):
    """Byte for byte: `data: {json}` events, each ended by LF and an empty line (no CR,
    no comments), the usage chunk with no choices, then `data: [DONE]`. Clients split
    the body on "\\n\\n" (vLLM's benchmark client does), whatever the reads."""
    import httpx
    prompt = predd.call("tokenize", text="The river")["tokens"]
    with httpx.Client(base_url=server.url, timeout=300) as http:
        response = http.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}})
    body = response.content.decode()
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-store"
    assert "\r" not in body and body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    # a chunk per token, then the finish reason in a chunk of its own
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 6 + ["length"]
    assert chunks[-2]["choices"][0]["text"] == ""


def test_n_forks_one_prefill(client, predd, model):
    messages = [{"role": "system", "content": "You are Quill, a poet who names colours."},
                {"role": "user", "content": "Name a colour you like."}]
    tokens = template(predd, messages)
    before = predd.call("stats")["tokens_computed"]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                       temperature=0.9, n=4, seed=7)
    computed = predd.call("stats")["tokens_computed"] - before
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the prompt is computed once (all but its last token, which each branch feeds to
    # get its own first token), plus every generated token but each branch's last
    assert computed == (len(tokens) - 1) + r.usage.completion_tokens
    assert r.usage.prompt_tokens == len(tokens)


def test_repeated_system_prompt_is_cached(client, predd, model, server):
    system = {"role": "system", "content": "You are Atlas, a geography tutor. You answer "
              "questions about capitals, rivers and mountains in one friendly sentence."}
    first = [system, {"role": "user", "content": "Which river flows through Cairo?"}]
    second = [system, {"role": "user", "content": "What is the tallest mountain?"}]
    r1 = client.chat.completions.create(model=model, messages=first, max_tokens=8,
                                        temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    before, steps = (predd.call("stats")[k] for k in ("tokens_computed", "steps"))
    r2 = client.chat.completions.create(model=model, messages=second, max_tokens=8,
                                        temperature=0)
    computed = predd.call("stats")["tokens_computed"] - before
    # one generate computes the rest of the prompt and picks the first token in one step
    assert predd.call("stats")["steps"] - steps == r2.usage.completion_tokens
    t1, t2 = template(predd, first), template(predd, second)
    shared = common_prefix(t1, t2)
    system_turn = predd.call("chat_template", messages=[system],
                             add_generation_prompt=False)["tokens"]
    assert shared >= len(system_turn) >= 16
    assert r2.usage.prompt_tokens_details.cached_tokens == shared
    assert computed == len(t2) - 1 - shared + r2.usage.completion_tokens
    files = os.listdir(os.path.join(server.mount, "openai"))
    assert files and all(f.endswith(".kv") for f in files)


def test_json_schema_response_validates(client, model):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]},
                      "minItems": 1, "maxItems": 3}},
        "required": ["name", "age", "languages"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, max_tokens=48, temperature=0.7, seed=3,
        messages=[{"role": "user", "content": "Describe a programmer as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "programmer", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"name", "age", "languages"}
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 12
    assert isinstance(doc["age"], int) and 18 <= doc["age"] <= 99
    assert 1 <= len(doc["languages"]) <= 3
    assert set(doc["languages"]) <= {"python", "c", "rust", "go"}


def test_stop_string_cuts_the_answer(client, predd, model):
    messages = [{"role": "user", "content": "List three fruits."}]
    ids, text = greedy(predd, template(predd, messages), 12)
    stop = text[len(text) // 2:len(text) // 2 + 3]     # a string the answer will contain
    assert len(stop) == 3
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                       temperature=0, stop=[stop, "never seen"])
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completion_with_logprobs(client, predd, model):
    prompt = "The capital of France is"
    ids, text = greedy(predd, predd.call("tokenize", text=prompt)["tokens"], 4)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                  logprobs=2)
    choice = r.choices[0]
    assert choice.text == text
    lp = choice.logprobs
    assert len(lp.tokens) == len([t for t in ids if t not in EOS])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))


def test_a_batch_of_prompts_gets_n_choices_each_in_prompt_order(client, predd, model):
    """prompt as a list: choice i * n + j is the jth of prompt i, as vLLM answers it;
    usage counts every prompt; text and token-id batches alike; streamed the same."""
    texts = ["The capital of France is", "Two plus two makes", "A river flows"]
    ids = [predd.call("tokenize", text=t)["tokens"] for t in texts]
    greedies = [greedy(predd, tokens, 5) for tokens in ids]
    want = [text for _, text in greedies]
    for prompt in (texts, ids):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                      temperature=0, n=2, echo=True)
        assert [c.index for c in r.choices] == list(range(6))
        assert [c.text for c in r.choices] == [texts[i] + want[i] for i in range(3)
                                                for _ in range(2)]
        assert r.usage.prompt_tokens == sum(len(t) for t in ids)
        assert r.usage.completion_tokens == 2 * sum(len(out) for out, _ in greedies)
    stream = client.completions.create(model=model, prompt=texts, max_tokens=5, n=2,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    got, finished, usage = [""] * 6, [None] * 6, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert got == [w for w in want for _ in range(2)] and finished == ["length"] * 6
    assert usage.prompt_tokens == sum(len(t) for t in ids)


@pytest.mark.parametrize("prompt,n,param", [
    ([], 1, "prompt"), (["a", [1, 2]], 1, "prompt"), ([[1, 2], []], 1, "prompt"),
    ([True], 1, "prompt"), (["x"] * 65, 1, "prompt"), (["x"] * 33, 2, "n"),
    (["x", ""], 1, "prompt")])
def test_a_batch_that_is_not_one_is_400(client, model, prompt, n, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, n=n, stream=True)
    assert err.value.status_code == 400 and err.value.body["param"] == param


def test_a_schema_that_does_not_compile_is_400_before_a_stream_starts(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "frob"}}})
    assert err.value.status_code == 400 and err.value.body["param"] == "response_format"


def test_echo_with_logprobs_scores_the_prompt_too(client, predd, model):
    """echo + logprobs, as vLLM answers it (evaluation harnesses read a prompt's
    likelihood so): an entry for every prompt token, none for the first, then the
    completion's; each the token's logprob after the tokens before it in predd's own
    logits; text_offset from the start of the echoed text."""
    text = "The capital of France is Paris, and the capital of Italy is Rome. " * 3
    prompt = predd.call("tokenize", text=text)["tokens"]
    assert len(prompt) > 2 * 16                  # more than one call of prompt rows
    r = client.completions.create(model=model, prompt=text, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == n + 3 and r.choices[0].text.startswith(text)
    assert lp.tokens[:n] == [predd.call("detokenize", tokens=[t])["text"] for t in prompt]
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(text)
    kv = predd.call("kv_create")
    try:
        header, frames = predd.request("pred", cap=kv["cap"], tokens=prompt[:-1],
                                       outputs=list(range(n - 1)))
    finally:
        predd.call("kv_free", cap=kv["cap"])
    rows = np.frombuffer(frames[0], np.float32).reshape(header["logits"]["shape"])
    rows = rows.astype(np.float64)
    logprobs = rows - rows.max(1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(1, keepdims=True))
    want = [float(logprobs[i - 1, prompt[i]]) for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=2e-3)
    for i in range(1, n):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and len(top) in (2, 3)   # the two best, and the token
        assert max(top.values()) == pytest.approx(float(logprobs[i - 1].max()), abs=2e-3)
    # streamed: the same entries, the prompt's in the first chunk with the echoed text
    chunks = list(client.completions.create(model=model, prompt=text, max_tokens=3,
                                            temperature=0, echo=True, logprobs=2,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text == text and first.logprobs.token_logprobs[0] is None
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs
                for v in ch.logprobs.token_logprobs]
    # (the same within the bf16 kernels' rounding: a row's bits may move with the other
    # rows of its step, here the first request's prefix cache file being saved)
    assert len(streamed) == n + 3
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=2e-3)


def test_chat_top_logprobs(client, model):
    r = client.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)   # greedy: the top one


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 3.0}, "temperature"),
    ({"n": 0}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 3}}, "min_tokens"),        # more than max_tokens
    ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
])
def test_invalid_requests_are_400(client, model, kwargs, param):
    args = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param
    assert err.value.body["type"] == "invalid_request_error"


def test_a_prompt_no_context_can_hold_is_400_before_it_is_encoded(client, model):
    """SmolLM2's longest token is 81 characters and its context 8,192 tokens: a prompt of
    more than 663,552 characters cannot fit, whatever it encodes to, and is refused by its
    length (the message says so); a shorter one is encoded (in the program) and refused by
    its token count."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="ab" * 340_000, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "prompt" and "680000 characters" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="ab " * 20_000, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "max_tokens"


def test_a_lone_surrogate_is_400(server, model):
    """JSON's escapes can name half a UTF-16 pair, which is no text (the openai package
    cannot send one: it is written raw)."""
    import httpx
    body = '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 1}' % model
    reply = httpx.post(server.url + "/v1/completions", content=body.encode(), timeout=60,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "lone surrogate" in reply.json()["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-5", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"


def test_a_client_that_leaves_cancels_its_request(client, predd, model):
    before = predd.call("stats")["pages_used"]
    stream = client.chat.completions.create(
        model=model, max_tokens=400, temperature=0.8, stream=True,
        messages=[{"role": "user", "content": "Tell me a very long story about a lighthouse."}])
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    # the LIP cancels its generate in predd (it ends after its current step) and frees
    assert eventually(lambda: predd.call("stats")["pending_calls"] == 0, timeout=120)
    assert eventually(lambda: predd.call("stats")["pages_used"] == before, timeout=30)


def test_our_load_client_reads_every_token_of_every_stream(server):
    """scripts/bench_openai.py over HTTP: ignore_eos streams of token-id prompts, each
    request's usage read from its stream."""
    from types import SimpleNamespace

    from scripts.bench_openai import Http, run
    client = Http(server.url)
    args = SimpleNamespace(num_prompts=4, input_len=24, output_len=7, concurrency=2)
    got = run(lambda req, _i: client.complete(req), client.model, args)
    assert (got["completed"], got["failed"], got["total_output_tokens"]) == (4, 0, 28)
    assert got["errors"] == []
