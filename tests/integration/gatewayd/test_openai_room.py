"""The OpenAI program under memory pressure, through a real `symphony serve` whose
predd gives the program's uid few KV pages (`--uid-quota`): concurrent requests that do
not fit together all finish, none with a 429, as in vLLM (openai_lip/room.py); one that
cannot fit even alone is a 429 EDQUOT."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.gateway_fixtures import checked_client, finish, start_serve

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="symphony serve needs root"),
              pytest.mark.slow]
QUOTA = 40          # pages of 16 tokens for the OpenAI program's uid
PAGE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_serve(str(tmp_path_factory.mktemp("room")), "--uid-quota", str(QUOTA))
    yield s
    finish(s)


def complete(url: str, model: str, prompt: list[int], max_tokens: int,
             stream: bool) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    with httpx.Client(base_url=url, timeout=600) as http:
        return http.post("/v1/completions", json=body)


def test_requests_that_do_not_fit_together_all_finish(server):
    with checked_client(server) as predd:
        model = predd.call("info")["model"]
        prompts = [predd.call("tokenize", text=f"Story {i}: the river and the lantern "
                              f"{'went on and on ' * 12}")["tokens"] for i in range(8)]
    need = [-(-(len(p) + 48) // PAGE) for p in prompts]
    assert max(need) < QUOTA < sum(need)        # each fits alone, all together do not

    def one(i: int) -> tuple[int, int, str]:
        r = complete(server.url, model, prompts[i], 48, stream=i % 2 == 1)
        if i % 2 == 0:
            body = r.json()
            assert "usage" in body, body
            return r.status_code, body["usage"]["completion_tokens"], \
                body["choices"][0]["finish_reason"]
        chunks = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: {")]
        last = json.loads(chunks[-1])
        reasons = [c["choices"][0]["finish_reason"] for c in map(json.loads, chunks[:-1])]
        assert "error" not in r.text, r.text[-500:]
        return r.status_code, last["usage"]["completion_tokens"], reasons[-1]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert results == [(200, 48, "length")] * 8


def test_a_request_that_cannot_fit_alone_is_a_429(server):
    with checked_client(server) as predd:
        prompt = predd.call("tokenize", text="lantern " * 300)["tokens"]
        model = predd.call("info")["model"]
    assert -(-(len(prompt) + 400) // PAGE) > QUOTA
    r = complete(server.url, model, prompt, 400, stream=False)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "EDQUOT"


def test_a_batch_that_does_not_fit_at_once_finishes_and_one_that_cannot_is_a_429(server):
    """The eight prompts above as one batch: its prompts, each a holder of memory in
    the program's room, wait for each other as separate requests do; a batch with a
    prompt that cannot fit alone fails with it (the other prompt halted, its cache
    freed)."""
    with checked_client(server) as predd:
        model = predd.call("info")["model"]
        prompts = [predd.call("tokenize", text=f"Story {i}: the river and the lantern "
                              f"{'went on and on ' * 12}")["tokens"] for i in range(8)]
        huge = predd.call("tokenize", text="lantern " * 520)["tokens"]
    need = [-(-(len(p) + 48) // PAGE) for p in prompts]
    r = complete(server.url, model, prompts, 48, stream=False)
    assert r.status_code == 200, r.text[-500:]
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(8))
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 8
    assert body["usage"]["completion_tokens"] == 8 * 48
    # a short prompt first (whose answer is kept for the prefix cache) and a long one
    # that fits only once the short one's cache goes back
    long = huge[:500]
    assert -(-(len(long) + 48) // PAGE) + need[0] > QUOTA
    r = complete(server.url, model, [prompts[0], long], 48, stream=False)
    assert r.status_code == 200, r.text[-500:]
    assert r.json()["usage"]["completion_tokens"] == 2 * 48
    r = complete(server.url, model, [prompts[0], huge], 400, stream=False)
    assert r.status_code == 429 and r.json()["error"]["code"] == "EDQUOT"
    r = complete(server.url, model, prompts[:2], 48, stream=False)     # it goes on
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * 48
    r = complete(server.url, model, huge, 400, stream=False)           # nothing leaked:
    assert r.status_code == 429                # alone it still cannot fit, and says so
