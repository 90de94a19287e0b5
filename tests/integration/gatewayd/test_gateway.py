"""Programs over HTTP against a real `symphony serve` (predd, kvfsd, gateway): SSE
output, exit status and cost, interactive input, DELETE freeing KV pages at once,
disconnects, per-key limits and identities, uploads, /health and /metrics."""
from __future__ import annotations

import json
import math
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.launcher import Launcher
from tests.integration.gateway_fixtures import (LIPS, Event, checked_client, eventually,  # noqa: F401
                                                finish, http, sse_events, start_serve)

ALICE, BOB, CAROL = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef", \
    "sk-carol-0123456789abcdef"
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="symphony serve needs root"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    keys = tmp / "keys"
    keys.write_text(f"# test keys\n{ALICE} 1001 alice runs=2\n{BOB} 1002 bob runs=1 wall=4\n"
                    f"{CAROL} 1003 carol pages=1\n")
    os.chmod(keys, 0o600)
    s = start_serve(str(tmp), "--api-keys", str(keys), "--allow-uploads", "--programs", LIPS)
    yield s
    finish(s)


@pytest.fixture
def predd(server):
    with checked_client(server) as c:
        yield c


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def run_events(http, path: str, key: str, body: dict) -> list[Event]:
    with http.stream("POST", path, json=body, headers=auth(key)) as r:
        assert r.status_code == 200, r.read()
        return list(sse_events(r))


def stdout(events: list[Event]) -> list[str]:
    return [e.data for e in events if e.kind == "stdout"]


def metrics(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def wait_state(http, run_id: str, key: str, states=("exited", "killed", "failed")) -> dict:
    return eventually(lambda: (lambda r: r if r["state"] in states else None)(
        http.get(f"/v1/runs/{run_id}", headers=auth(key)).json()), timeout=60)


# ---------------------------------------------------------------- the basics

def test_health_programs_and_keys(http):
    r = http.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "predd": True, "kvfs": True, "openai": True}
    r = http.get("/v1/programs")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/programs", headers=auth("sk-nobody-0123456789abcdef")).status_code == 401
    programs = {p["name"]: p["kind"] for p in
                http.get("/v1/programs", headers=auth(ALICE)).json()["data"]}
    assert programs["basic_decoding"] == "python"
    assert programs["agent"] == "shell"
    assert programs["holder"] == "python"
    assert "common" not in programs            # a library module, not a program


def test_run_streams_output_exit_and_cost(http, predd):
    prompt = "Count from one to twenty, separated by commas."
    events = run_events(http, "/v1/programs/basic_decoding/runs", ALICE,
                        {"args": [prompt, "--max-tokens", "8"]})
    assert events[0].kind == "run"
    run_id = events[0].json()["id"]
    assert [e.kind for e in events][-1] == "exit"
    assert [int(e.id) for e in events] == list(range(1, len(events) + 1))
    end = events[-1].json()
    assert end["status"] == 0 and end["state"] == "exited"
    # predd's figures for the same greedy decode: 8 tokens, none of them EOS
    tokens = predd.call("chat_template", messages=[{"role": "user", "content": prompt}])["tokens"]
    kv = predd.call("kv_create")
    ref = predd.call("generate", cap=kv["cap"], tokens=tokens, max_tokens=8, stream=False)
    predd.call("kv_free", cap=kv["cap"])
    assert len(ref["tokens"]) == 8 and not set(ref["tokens"]) & {0, 2}
    text = predd.call("detokenize", tokens=ref["tokens"], skip_special=True)["text"]
    assert stdout(events) == [text]
    cost = end["cost"]
    assert cost["tokens_exclusive"] is True
    assert cost["tokens_computed"] == len(tokens) + 7      # the last token is not fed
    assert cost["peak_pages"] == math.ceil((len(tokens) + 7) / 16)
    assert cost["sessions"] == 1 and cost["sessions_ended"] is True
    state = http.get(f"/v1/runs/{run_id}", headers=auth(ALICE)).json()
    assert state["state"] == "exited" and state["exit_status"] == 0
    assert state["cost"] == cost and state["owner"] == "alice" and state["uid"] == 1001
    assert http.get(f"/v1/runs/{run_id}", headers=auth(BOB)).status_code == 404


def test_interactive_input_and_delete_frees_pages_at_once(http, predd):
    before = predd.call("stats")["pages_used"]
    r = http.post("/v1/programs/holder/runs", headers=auth(ALICE),
                  json={"args": ["40"], "interactive": True, "detach": True})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    assert r.json()["state"] == "running"
    with http.stream("GET", f"/v1/runs/{run_id}/events", headers=auth(ALICE)) as events:
        lines = []
        for e in sse_events(events):
            if e.kind == "stdout":
                lines.append(e.data)
                if e.data == "holding 3 pages":
                    r = http.post(f"/v1/runs/{run_id}/input", headers=auth(ALICE),
                                  json={"data": "hello"})
                    assert r.json() == {"id": run_id, "written": 5, "eof": False}
                if e.data == "got: hello":
                    break
    assert lines == ["holding 3 pages", "got: hello"]
    assert predd.call("stats")["pages_used"] == before + 3
    r = http.delete(f"/v1/runs/{run_id}", headers=auth(ALICE))
    assert r.status_code == 200
    assert predd.call("stats")["pages_used"] == before     # freed when DELETE returns
    state = r.json()
    assert state["state"] == "killed" and state["reason"] == "killed by DELETE"
    assert state["cost"]["peak_pages"] == 3 and state["cost"]["sessions_ended"] is True
    r = http.post(f"/v1/runs/{run_id}/input", headers=auth(ALICE), json={"data": "late"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "EPIPE"
    # the whole event log is kept: replay from the start ends with `exit`
    with http.stream("GET", f"/v1/runs/{run_id}/events", headers=auth(ALICE)) as events:
        kinds = [e.kind for e in sse_events(events)]
    assert kinds[0] == "run" and kinds[-1] == "exit"


def test_disconnect_kills_an_attached_run(http, predd):
    before = predd.call("stats")["pages_used"]
    with http.stream("POST", "/v1/programs/holder/runs", headers=auth(ALICE),
                     json={"args": ["40"], "interactive": True}) as r:
        run_id = r.headers["x-symphony-run"]
        for e in sse_events(r):
            if e.data == "holding 3 pages":
                break
    state = wait_state(http, run_id, ALICE)
    assert state["state"] == "killed" and state["reason"] == "client disconnected"
    assert predd.call("stats")["pages_used"] == before


def test_detached_run_lives_on_and_takes_input(http):
    r = http.post("/v1/programs/holder/runs", headers=auth(ALICE),
                  json={"args": ["8"], "interactive": True, "detach": True})
    run_id = r.json()["id"]
    assert http.post(f"/v1/runs/{run_id}/input", headers=auth(ALICE),
                     json={"data": "one"}).status_code == 200
    assert http.post(f"/v1/runs/{run_id}/input", headers=auth(ALICE),
                     json={"eof": True}).status_code == 200
    state = wait_state(http, run_id, ALICE)
    assert state["state"] == "exited" and state["exit_status"] == 0
    with http.stream("GET", f"/v1/runs/{run_id}/events", headers=auth(ALICE)) as events:
        assert stdout(list(sse_events(events))) == ["holding 1 pages", "got: one", "bye"]
    ids = [x["id"] for x in http.get("/v1/runs", headers=auth(ALICE)).json()["data"]]
    assert run_id in ids
    assert run_id not in [x["id"] for x in http.get("/v1/runs", headers=auth(BOB)).json()["data"]]


def test_stdin_without_interactive_is_closed(http):
    events = run_events(http, "/v1/programs/holder/runs", ALICE,
                        {"args": ["4"], "stdin": "a\nb\n"})
    assert stdout(events) == ["holding 1 pages", "got: a", "got: b", "bye"]
    assert events[-1].json()["status"] == 0


# ---------------------------------------------------------------- limits and checks

def test_concurrent_runs_and_wall_time_limits(http):
    r = http.post("/v1/programs/holder/runs", headers=auth(BOB),
                  json={"interactive": True, "detach": True})
    assert r.status_code == 201
    run_id = r.json()["id"]
    r = http.post("/v1/programs/holder/runs", headers=auth(BOB), json={"detach": True})
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "EAGAIN" and r.json()["error"]["type"] == \
        "rate_limit_error"
    state = wait_state(http, run_id, BOB)                  # bob's wall limit is 4 s
    assert state["state"] == "killed" and state["reason"].startswith("ETIME")


def test_pages_limit_refuses_a_new_run(http):
    r = http.post("/v1/programs/holder/runs", headers=auth(CAROL),
                  json={"args": ["20"], "interactive": True, "detach": True})
    run_id = r.json()["id"]
    assert eventually(lambda: http.get(f"/v1/runs/{run_id}", headers=auth(CAROL))
                      .json()["cost"].get("pages") == 2)
    r = http.post("/v1/programs/holder/runs", headers=auth(CAROL), json={"detach": True})
    assert r.status_code == 429 and r.json()["error"]["code"] == "EDQUOT"
    http.delete(f"/v1/runs/{run_id}", headers=auth(CAROL))


@pytest.mark.parametrize("body,param", [
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
    ({"env": {"PATH": "/tmp"}}, "env"),
    ({"args": "not a list"}, "args"),
    ({"args": [1, 2]}, "args"),
    ({"detach": "yes"}, "detach"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_run_requests_are_400(http, body, param):
    r = http.post("/v1/programs/holder/runs", headers=auth(ALICE), json=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "EINVAL" and r.json()["error"]["param"] == param


def test_unknown_and_malformed_requests(http):
    r = http.post("/v1/programs/no_such_program/runs", headers=auth(ALICE), json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "ENOENT"
    assert http.get("/v1/runs/run_0000", headers=auth(ALICE)).status_code == 404
    assert http.get("/v1/nothing/here").json()["error"]["code"] == "ENOENT"
    assert http.post("/v1/programs/holder/runs", headers=auth(ALICE),
                     content=b"{not json").status_code == 400
    r = http.post("/v1/programs/holder/runs", headers=auth(ALICE), content=b" " * (3 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "EFBIG"


def test_safe_env_reaches_the_program(http):
    events = run_events(http, "/v1/runs", ALICE, {
        "filename": "greet.sh", "source": 'echo "$APP_GREETING from $SYMPHONY_RUN"\n',
        "env": {"APP_GREETING": "hello"}})
    run_id = events[0].json()["id"]
    assert stdout(events) == [f"hello from {run_id}"]


# ---------------------------------------------------------------- uploads, identity

def test_uploaded_python_program_uses_liblip(http, predd, server):
    source = "import liblip as lip\nprint(lip.tokenize('Hello world'))\n"
    events = run_events(http, "/v1/runs", ALICE, {"filename": "tok.py", "source": source})
    expected = predd.call("tokenize", text="Hello world")["tokens"]
    assert stdout(events) == [str(expected)]
    assert events[-1].json()["status"] == 0
    run_id = events[0].json()["id"]
    assert os.path.isdir(os.path.join(server.rundir, "uploads"))
    assert not os.path.exists(os.path.join(server.rundir, "uploads", run_id))   # removed


@pytest.mark.parametrize("body,status,param", [
    ({"filename": "x.exe", "source": "x"}, 400, "filename"),
    ({"filename": "../x.py", "source": "x"}, 400, "filename"),
    ({"filename": "x.py"}, 400, "source"),
    ({"filename": "big.py", "source": "#" * (256 * 1024 + 1)}, 413, "source"),
])
def test_bad_uploads(http, body, status, param):
    r = http.post("/v1/runs", headers=auth(ALICE), json=body)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param


def test_a_run_has_its_keys_uid(http, server):
    if not Launcher.probe(server.predd_addr, server.mount).takes_uid:
        pytest.skip("this lip run --sandbox takes no --uid")
    events = run_events(http, "/v1/runs", BOB, {"filename": "who.sh", "source": "id -u\n"})
    assert stdout(events) == ["1002"]


# ---------------------------------------------------------------- metrics

def test_metrics_parse_and_count(http, predd):
    before = metrics(http)
    assert http.get("/v1/programs").status_code == 401
    run_events(http, "/v1/programs/holder/runs", ALICE, {"args": ["4"]})
    m = metrics(http)
    stats = predd.call("stats")
    assert m[("symphony_predd_up", ())] == 1
    assert m[("symphony_kv_pages_total", ())] == 512
    assert m[("symphony_kv_pages_used", ())] == stats["pages_used"]
    assert m[("symphony_tokens_computed_total", ())] == stats["tokens_computed"]
    assert m[("symphony_tokens_reused_total", ())] == stats["tokens_reused"]
    assert m[("symphony_steps_total", ())] == stats["steps"]
    assert m[("symphony_batch_picks_failed_total", ())] == stats["batch_picks_failed"] == 0
    assert m[("symphony_answered_in_flight_total", ())] == stats["answered_in_flight"] == 0
    assert m[("symphony_step_seconds_count", ())] == stats["steps"]
    assert m[("symphony_step_seconds_bucket", (("le", "+Inf"),))] == stats["steps"]
    steps = stats["step_hist"]
    assert m[("symphony_step_seconds_bucket", (("le", "0.1"),))] == \
        steps["cumulative"][steps["le_ms"].index(100)]
    assert m[("symphony_step_seconds_sum", ())] == pytest.approx(steps["sum_ms"] / 1e3)
    admitted = stats["queue_wait_hist"]["cumulative"][-1]
    assert admitted > 0 and m[("symphony_queue_wait_seconds_count", ())] == admitted
    for name in ("symphony_kv_objects", "symphony_sessions", "symphony_mean_batch"):
        assert (name, ()) in m

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return m.get(key, 0) - before.get(key, 0)
    assert delta("symphony_errors_total", errno="invalid_api_key") == 1
    assert delta("symphony_http_requests_total", route="/v1/programs", method="GET",
                 status="401") == 1
    assert delta("symphony_http_requests_total", route="/v1/programs/{name}/runs",
                 method="POST", status="200") == 1
    assert delta("symphony_runs_finished_total", program="holder") == 1
    assert delta("symphony_runs_failed_total", program="holder") == 0
    assert m[("symphony_runs_active", (("program", "holder"),))] == 0
    assert delta("symphony_http_requests_total", route="/metrics", method="GET",
                 status="200") == 1
