"""`symphony serve --replicas 2` for real: two predds (real model, one thread each) under
one kvfsd and one gateway. Both replicas answer and show in /metrics; a run's JSON and
its `run` event name its replica, and `near` places it where its file lives; a second
OpenAI request with the same long system prompt is routed where the first went and
reuses its cache; a SIGKILLed replica leaves the server serving and is started again;
SIGTERM stops everything (exit 0, nothing mounted: the module's teardown).

The tests that need kvfsd's replica support (`user.kv.replica`, a file homed on a
replica other than kvfsd's only one) skip when the mount root has no `user.kv.replicas`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from liblip.client import Client, LipError
from tests.conftest import ROOT
from tests.integration.gateway_fixtures import (LIPS, eventually, finish, http,  # noqa: F401
                                                sse_events, start_serve)

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="symphony serve needs root"),
              pytest.mark.slow]

SYSTEM = ("You are the assistant of a library of caches. You answer every question in "
          "one short sentence, politely, and you never invent facts about memory. ") * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    s = start_serve(str(tmp), "--replicas", "2", "--threads", "1", "--programs", LIPS)
    yield s
    finish(s)


def addrs(server) -> list[str]:
    return [f"ipc://{server.rundir}/predd.sock", f"ipc://{server.rundir}/predd-1.sock"]


def metrics(http) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def replica_up(http, addr: str) -> float | None:
    return metrics(http).get(("symphony_replica_up", (("replica", addr),)))


def need_kvfsd_replicas(server) -> None:
    try:
        os.getxattr(server.mount, "user.kv.replicas")
    except OSError:
        pytest.skip("kvfsd without replicas (no user.kv.replicas on the mount root)")


def ping(addr: str) -> bool:
    try:
        c = Client(addr, name="replicas-test")
    except LipError:
        return False
    try:
        return c.call("ping", timeout=5)["ok"] is True
    except LipError:
        return False
    finally:
        c.close()


def test_both_replicas_start_and_answer(server, http):
    assert server.ready_line == f"ready {server.url}"
    for addr in addrs(server):
        assert os.path.exists(addr[len("ipc://"):])
        assert ping(addr)
        assert replica_up(http, addr) == 1.0
        assert metrics(http)[("symphony_replica_runs", (("replica", addr),))] == 0.0
    assert metrics(http)[("symphony_predd_up", ())] == 1.0
    log = server.log_text()
    assert "\npredd[0]: " in log and "\npredd[1]: " in log and "\npredd: " not in log
    assert "gatewayd: openai[0]: ready" in log and "gatewayd: openai[1]: ready" in log
    health = http.get("/health").json()
    assert health["status"] == "ok"
    assert health["replicas"] == {a: True for a in addrs(server)}
    assert ("symphony_kv_migrations_total", ()) in metrics(http)


def test_near_must_be_a_list_of_strings(http):
    for near in ("a.kv", [1], {"a": 1}, [""]):
        r = http.post("/v1/programs/holder/runs", json={"near": near, "detach": True})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "EINVAL"
        assert r.json()["error"]["param"] == "near"


def test_a_run_names_its_replica(server, http):
    # no hints, nothing in flight: replica 0; missing files in `near` are ignored
    r = http.post("/v1/programs/holder/runs", json={
        "args": ["16"], "interactive": True, "detach": True,
        "near": ["no-such.kv", "/etc/passwd", "../../etc/passwd"]})
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["replica"] == addrs(server)[0]
    assert http.get(f"/v1/runs/{run['id']}").json()["replica"] == addrs(server)[0]
    eventually(lambda: metrics(http)[("symphony_replica_runs",
                                      (("replica", addrs(server)[0]),))] == 1.0)
    assert http.post(f"/v1/runs/{run['id']}/input", json={"eof": True}).status_code == 200
    with http.stream("GET", f"/v1/runs/{run['id']}/events") as s:
        events = list(sse_events(s))
    assert events[0].kind == "run"
    assert events[0].json() == {"id": run["id"], "program": "holder",
                                "replica": addrs(server)[0]}
    assert events[-1].kind == "exit" and events[-1].json()["status"] == 0
    assert metrics(http)[("symphony_replica_runs", (("replica", addrs(server)[0]),))] == 0.0


def test_near_places_a_run_on_the_files_home(server, http):
    need_kvfsd_replicas(server)
    a0, a1 = addrs(server)
    path = os.path.join(server.mount, "near.kv")
    save = ("import liblip as lip; kv = lip.kv_create(); "
            "lip.prefill(kv, list(range(100, 140))); lip.kv_save(kv, 'near.kv')")
    subprocess.run([sys.executable, "-c", save], check=True, cwd=ROOT, timeout=60,
                   env={**os.environ, "PYTHONPATH": ROOT, "PREDD_ADDR": a0,
                        "KVFS_MOUNT": server.mount})
    assert os.getxattr(path, "user.kv.replica").decode() == a0
    assert int(os.getxattr(path, "user.kv.tokens")) == 40
    os.setxattr(path, "user.kv.rehome", a1.encode())
    assert os.getxattr(path, "user.kv.replica").decode() == a1
    assert int(os.getxattr(path, "user.kv.tokens")) == 40
    for near in (["near.kv"], [path], ["no-such.kv", "near.kv"]):
        r = http.post("/v1/programs/holder/runs", json={"args": ["16"], "detach": True,
                                                        "near": near})
        assert r.status_code == 201, r.text
        assert r.json()["replica"] == a1
        http.delete(f"/v1/runs/{r.json()['id']}")
    os.unlink(path)


def test_same_system_prompt_is_served_from_the_cache(server):
    need_kvfsd_replicas(server)
    from openai import OpenAI
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    cached = []
    for question in ("What is a KV cache?", "What is a page of memory?"):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": question}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0
    assert cached[1] > 0


def predd_pid(rundir: str, index: int) -> int:
    sock = f"ipc://{rundir}/predd-{index}.sock"
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"predd" in argv and sock.encode() in argv:
                return int(name)
    raise AssertionError(f"no predd serves {sock}")


def test_a_killed_replica_is_started_again(server, http):
    a0, a1 = addrs(server)
    pid = predd_pid(server.rundir, 1)
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: replica_up(http, a1) == 0.0)
    # the server still serves: health says degraded, 200, and which replica is down
    health = http.get("/health")
    assert health.status_code == 200, health.text
    assert health.json() | {"openai": None} == {
        "status": "degraded", "predd": False, "kvfs": True, "openai": None,
        "replicas": {a0: True, a1: False}}
    # the server still serves: a chat completion (routed to replica 0) answers
    r = http.post("/v1/chat/completions", json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "Say yes."}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    # and replica 1 comes back: a new process, its socket answers, its LIP is ready
    eventually(lambda: "symphony: predd[1] (" + a1 + ") is back" in server.log_text(),
               timeout=120)
    assert f"symphony: predd[1] ({a1}) exited (-9); starting it again in 1 s" \
        in server.log_text()
    assert predd_pid(server.rundir, 1) != pid
    assert ping(a1)
    assert replica_up(http, a1) == 1.0
    eventually(lambda: server.log_text().count("gatewayd: openai[1]: ready") == 2,
               timeout=120)
    assert http.get("/health").json()["status"] == "ok"
    assert json.loads(http.get("/health").text)["replicas"] == {a0: True, a1: True}
