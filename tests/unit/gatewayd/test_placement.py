"""Placement of runs and routing of OpenAI requests among replicas: the 1.5x load cap,
affinity, ties, no hints (gatewayd/placement.py, gatewayd/prefix_routes.py)."""
from __future__ import annotations

import sys

import pytest

from gatewayd.placement import choose, under_cap
from gatewayd.prefix_routes import PrefixRoutes, prompt_text, shared_prefix


# ---------------------------------------------------------------- the cap

def test_cap_is_one_and_a_half_times_the_mean_inclusive():
    # mean 2, cap 3: 3 is in (not above), 4 would be out
    assert under_cap([3, 1, 2]) == [0, 1, 2]
    assert under_cap([4, 1, 1]) == [1, 2]           # mean 2, 4 > 3
    assert under_cap([1, 0]) == [1]                 # mean 0.5, cap 0.75
    assert under_cap([0, 0, 0]) == [0, 1, 2]        # nothing anywhere: all fit


def test_cap_boundary_is_in():
    assert under_cap([3, 1]) == [0, 1]              # mean 2, cap 3: 3 is not above it
    assert under_cap([3, 0, 1]) == [1, 2]           # mean 4/3, cap 2


def test_cap_ignores_dead_replicas():
    assert under_cap([None, 5, 5]) == [1, 2]        # mean over the live ones only
    assert under_cap([None, None]) == []
    assert under_cap([9, None, 1]) == [2]           # mean 5, cap 7.5


def test_cap_with_another_factor():
    assert under_cap([2, 1, 0], cap=1.0) == [1, 2]
    assert under_cap([2, 1, 0], cap=2.0) == [0, 1, 2]


# ---------------------------------------------------------------- choose

def test_no_hints_least_loaded_then_lowest_index():
    assert choose([0, 0], [0, 0]) == 0
    assert choose([1, 0], [0, 0]) == 1
    assert choose([2, 1, 1], [0, 0, 0]) == 1
    assert choose([None, 0, 0], [0, 0, 0]) == 1


def test_affinity_wins_within_the_cap():
    assert choose([1, 1], [0, 40]) == 1
    assert choose([2, 1, 1], [100, 0, 0]) == 0      # mean 4/3, cap 2: 2 is in
    assert choose([0, 0, 0], [10, 30, 30]) == 1     # tie between 1 and 2: lowest index


def test_affinity_over_the_cap_goes_elsewhere():
    # replica 0 holds everything but runs 3 of 4: mean 2, cap 3 -> in; 4 of 5 -> out
    assert choose([3, 1], [500, 0]) == 0
    assert choose([4, 1], [500, 0]) == 1
    assert choose([1, 0], [500, 0]) == 1            # mean 0.5: one run is over the cap


def test_affinity_tie_goes_to_the_least_loaded():
    assert choose([2, 1, 2], [64, 64, 0]) == 1
    assert choose([1, 1, 1], [64, 64, 0]) == 0


def test_dead_holder_is_not_chosen():
    assert choose([None, 0], [999, 0]) == 1
    assert choose([None, None], [1, 1]) is None


# ---------------------------------------------------------------- prefix routes

def test_shared_prefix_exact():
    assert shared_prefix("", "abc") == 0
    assert shared_prefix("abc", "abc") == 3
    assert shared_prefix("abcd", "abcx") == 3
    assert shared_prefix("abc", "abcdef") == 3
    assert shared_prefix("xbc", "abc") == 0


def test_prompt_text_scopes_and_shapes():
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": "hi"}]}
    assert prompt_text("alice", "chat", chat) == "alice\0<system>S\n<user>hi\n"
    assert prompt_text("bob", "chat", chat).startswith("bob\0")
    assert prompt_text("a", "completion", {"prompt": "once"}) == "a\0once"
    assert prompt_text("a", "completion", {"prompt": ["once"]}) == "a\0once"
    assert prompt_text("a", "completion", {"prompt": [1, 2]}) == "a\0[1, 2]"
    # a batch by its first prompt, whose answer the OpenAI program keeps
    assert prompt_text("a", "completion", {"prompt": ["once", "twice"]}) == "a\0once"
    assert prompt_text("a", "completion", {"prompt": [[1, 2], [3]]}) == "a\0[1, 2]"
    assert prompt_text("a", "chat", {"messages": "x"}) == ""
    assert prompt_text("a", "chat", {"messages": [3]}) == ""
    assert prompt_text("a", "models", None) == ""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert prompt_text("a", "chat", parts) == 'a\0<user>[{"text": "x", "type": "text"}]\n'


SYSTEM = "s\0" + "You are a careful assistant. " * 4


def test_second_prompt_with_the_same_prefix_follows_the_first():
    r = PrefixRoutes(2)
    first = r.route(SYSTEM + "question one", [0, 0])
    assert first == 0                                # no match: least loaded, lowest
    # the first is still in flight on 0: loads [1, 0], mean 0.5 -> 0 is over the cap
    assert r.route(SYSTEM + "question two", [1, 0]) == 1
    # once it is done: "question t" (two, on 1) beats "question " (one, on 0)
    assert r.route(SYSTEM + "question three", [0, 0]) == 1
    # an equal pull both ways: the tie goes to the least loaded, then the lowest index
    assert r.route(SYSTEM + "question five", [0, 0]) == 0
    assert r.route(SYSTEM + "question six", [2, 1]) == 1
    assert r.longest(0, SYSTEM + "question zero") == len(SYSTEM + "question ")
    assert r.longest(1, SYSTEM + "question zero") == len(SYSTEM + "question ")


def test_longest_prefix_decides():
    r = PrefixRoutes(3)
    r.remember(1, SYSTEM + "alpha beta gamma")
    r.remember(2, SYSTEM + "alpha delta")
    assert r.route(SYSTEM + "alpha beta zeta", [0, 0, 0]) == 1
    assert r.route(SYSTEM + "alpha delta epsilon", [1, 2, 1]) == 2   # mean 4/3, cap 2
    assert r.route(SYSTEM + "alpha beta", [0, 5, 0]) == 2            # 1 is over the cap


def test_short_match_counts_as_none():
    r = PrefixRoutes(2, min_chars=32)
    r.remember(1, "s\0" + "x" * 29 + "tail")      # shares 31 chars with the next
    assert r.longest(1, "s\0" + "x" * 29 + "other") == 0
    assert r.route("s\0" + "x" * 29 + "other", [0, 0]) == 0
    r.remember(1, "s\0" + "x" * 30 + "tail")      # 32 shared
    assert r.longest(1, "s\0" + "x" * 30 + "other") == 32


def test_memory_is_bounded_and_refreshed():
    r = PrefixRoutes(1, per_replica=3, min_chars=1)
    for p in ("a1", "b1", "c1"):
        r.remember(0, p)
    r.remember(0, "a1")                               # refreshed: now the newest
    r.remember(0, "d1")                               # drops b1, the oldest
    assert list(r.seen[0]) == ["c1", "a1", "d1"]
    assert r.longest(0, "b2") == 0
    assert r.longest(0, "a2") == 1


def test_no_prompt_no_memory():
    r = PrefixRoutes(2)
    assert r.route("", [0, 0]) == 0
    assert r.seen == [{}, {}]
    assert r.route("s\0x", [None, None]) is None


@pytest.mark.parametrize("loads,expect", [([0, 0, 0, 0], 2), ([0, 0, 6, 0], 0)])
def test_route_respects_cap_with_four(loads, expect):
    r = PrefixRoutes(4)
    r.remember(2, SYSTEM + "q")
    assert r.route(SYSTEM + "q2", loads) == expect


# ---------------------------------------------------------------- near files

def test_near_holdings_reads_home_and_tokens(monkeypatch):
    from gatewayd import replicas
    a0, a1 = "ipc:///r/predd.sock", "ipc:///r/predd-1.sock"
    files = {"/mnt/kvfs/a.kv": (a1, b"40"), "/mnt/kvfs/d/b.kv": (a0, b"16"),
             "/mnt/kvfs/c.kv": (a1, b"8"), "/mnt/kvfs/far.kv": ("tcp://10.0.0.9:5555", b"99"),
             "/mnt/kvfs/bad.kv": (a0, b"many"), "/etc/x.kv": (a0, b"1000")}
    asked = []

    def getxattr(path, name, follow_symlinks=True):
        asked.append(path)
        assert follow_symlinks is False
        if path not in files:
            raise FileNotFoundError(2, "No such file or directory")
        home, tokens = files[path]
        return home.encode() if name == "user.kv.replica" else tokens

    monkeypatch.setattr(replicas.os, "getxattr", getxattr)
    held = replicas.near_holdings("/mnt/kvfs/", [
        "a.kv", "/mnt/kvfs/d/b.kv", "d/../c.kv", "missing.kv", "far.kv", "bad.kv",
        "/etc/x.kv", "../../etc/x.kv", "/mnt/kvfs", "/mnt/kvfsX/a.kv"], [a0, a1])
    assert held == [16, 48]
    assert "/etc/x.kv" not in asked and "/mnt/kvfsX/a.kv" not in asked
    assert replicas.near_holdings("/mnt/kvfs", [], [a0, a1]) == [0, 0]


# ---------------------------------------------------------------- replica command lines

def test_replica_command_lines(monkeypatch):
    from gatewayd import replicas
    monkeypatch.setattr(replicas.os, "sched_getaffinity", lambda pid: set(range(8)))
    base = [sys.executable, "-m", "predd", "--rundir", "/r"]
    assert replicas.predd_argv("/r", 0, 1, None, ["--kv-pages", "64"]) == \
        base + ["--kv-pages", "64"]                              # one replica: as before
    assert replicas.predd_argv("/r", 0, 3, "m.gguf", []) == \
        base + ["--model", "m.gguf", "--threads", "2"]
    assert replicas.predd_argv("/r", 2, 3, None, ["--threads", "1"]) == \
        base + ["--threads", "1", "--addr", "ipc:///r/predd-2.sock", "--swap-dir", "/r/swap-2"]
    assert replicas.predd_argv("/r", 1, 16, None, ["--swap-dir=/s"])[-6:] == \
        ["--threads", "1", "--addr", "ipc:///r/predd-1.sock", "--swap-dir", "/s-1"]
    assert replicas.predd_argv("/r", 1, 2, None, ["--device", "cuda"])[5:9] == \
        ["--device", "cuda", "--threads", "4"]
    assert replicas.predd_argv("/r", 1, 2, None, ["--device", "cuda"])[9:11] == \
        ["--device", "cuda:1"]                                   # one GPU each
    assert "cuda:0" not in replicas.predd_argv("/r", 0, 1, None, ["--device", "cuda"])
    assert replicas.predd_argv("/r", 1, 2, None, ["--device", "cuda:3"]).count("--device") == 1
    assert replicas.local_addr("/r", 0) == "ipc:///r/predd.sock"


def test_loads_hide_down_and_remote_replicas():
    from gatewayd.replicas import Replica, Replicas
    from gatewayd.daemons import Daemon
    rs = Replicas([Replica(0, "ipc:///a", Daemon("predd[0]", [])),
                   Replica(1, "ipc:///b", Daemon("predd[1]", [])),
                   Replica(2, "tcp://10.0.0.2:5555")], print)
    rs.all[0].up = rs.all[2].up = True
    rs.take(0)
    rs.take(0)
    assert rs.loads() == [2, None, None]                 # remote only when no local is up
    rs.all[0].up = False
    assert rs.loads() == [None, None, 0]
    rs.release(0)
    rs.release(0)
    rs.release(0)                                        # never below zero
    assert rs.all[0].inflight == 0
    assert rs.live_addrs == ["tcp://10.0.0.2:5555"]
