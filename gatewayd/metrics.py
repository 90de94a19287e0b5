"""`GET /metrics`: Prometheus text, made by prometheus_client from one registry.

Two sources:
* predd's `stats`, read at every scrape (a collector; nothing is cached): pages
  total/used, objects, sessions, steps, calls and mean batch, tokens computed/reused,
  and histograms of queue wait (per call) and step time (per forward pass), from the
  bucket counts predd keeps;
* what the gateway itself sees: HTTP requests by route template, method and status;
  errors answered, by errno; runs active/finished/failed by program; and for the OpenAI
  API, tokens by kind and per-request histograms of queue wait, model time and latency
  (from the `cost` predd returns to the OpenAI LIP).

With replicas, predd's figures are summed over the replicas that answered (the
histograms bucket by bucket), `symphony_predd_up` is 1 only when every replica answered,
and per replica: `symphony_replica_up{replica}` and `symphony_replica_runs{replica}`
(runs and OpenAI requests in flight there); kvfsd's moves of caches between replicas
are `symphony_kv_migrations_total` and `symphony_kv_migrated_bytes_total` (the mount
root's `user.kv.migrations`, `COUNT BYTES`).
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

import liblip as lip

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _add(total: dict, s: dict) -> None:
    """Sum one replica's `stats` into `total` (numbers, histograms, tiers)."""
    for key, value in s.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
        elif key.endswith("_hist") and isinstance(value, dict):
            if key not in total:
                total[key] = {**value, "cumulative": list(value["cumulative"])}
            elif total[key]["le_ms"] == value["le_ms"]:
                total[key]["sum_ms"] += value["sum_ms"]
                total[key]["cumulative"] = [a + b for a, b in zip(total[key]["cumulative"],
                                                                  value["cumulative"])]
        elif key == "tiers" and isinstance(value, dict):
            tiers = total.setdefault("tiers", {})
            for tier, figures in value.items():
                mine = tiers.setdefault(tier, {"pages_total": 0, "pages_used": 0})
                for f in ("pages_total", "pages_used"):
                    mine[f] += figures.get(f, 0)
        elif key == "logits_rows" and isinstance(value, dict):
            rows = total.setdefault("logits_rows", {})
            for via, n in value.items():
                rows[via] = rows.get(via, 0) + n


def read_migrations(mount: str) -> tuple[int, int]:
    """kvfsd's `user.kv.migrations` on the mount root: (count, bytes); (0, 0) when it
    has none (a kvfsd without replicas)."""
    try:
        count, size = os.getxattr(mount, "user.kv.migrations").decode().split()
        return int(count), int(size)
    except (OSError, ValueError):
        return 0, 0


class PreddCollector:
    """predd's figures at scrape time; `symphony_predd_up` 0 when one does not answer."""

    def __init__(self, replicas=None, mount: str | None = None, timeout_s: float = 2.0) -> None:
        self.replicas = replicas      # gatewayd.replicas.Replicas, or None: the process's predd
        self.mount = mount
        self.timeout_s = timeout_s

    def describe(self):
        return []   # no help-time call to predd

    def _stats(self) -> list[tuple[object, dict | None]]:
        if self.replicas is None:
            try:
                return [(None, lip.client().call("stats", timeout=self.timeout_s))]
            except lip.LipError:
                return [(None, None)]
        out = []
        for r in self.replicas.all:
            try:    # a local replica known to be down is not asked (a reconnect waits)
                out.append((r, r.call("stats", timeout=self.timeout_s)
                            if r.up or not r.local else None))
            except lip.LipError:
                out.append((r, None))
        return out

    def collect(self):
        answers = self._stats()
        if self.replicas is not None:
            yield from self._replicas(answers)
        s: dict = {}
        for _, one in answers:
            if one is not None:
                _add(s, one)
        up = all(one is not None for _, one in answers)
        yield GaugeMetricFamily("symphony_predd_up", "predd answers stats (every replica)",
                                value=int(up))
        if not s:
            return
        if sum(one is not None for _, one in answers) > 1 and s.get("steps"):
            s["mean_batch"] = round(s.get("calls", 0) / s["steps"], 3)   # not a sum of means
        gauges = {"kv_pages_total": ("pages_total", "KV pages in predd's pool"),
                  "kv_pages_used": ("pages_used", "KV pages referenced by some object"),
                  "kv_objects": ("objects", "KV objects alive"),
                  "sessions": ("sessions", "predd sessions (connected programs)"),
                  "pending_calls": ("pending_calls", "pred/generate calls waiting or running"),
                  "mean_batch": ("mean_batch", "calls per forward pass, since start")}
        for name, (key, doc) in gauges.items():
            yield GaugeMetricFamily(f"symphony_{name}", doc, value=s.get(key, 0))
        counters = {"steps": ("steps", "forward passes"),
                    "calls": ("calls", "call chunks served by forward passes"),
                    "tokens_computed": ("tokens_computed", "tokens whose K/V predd computed"),
                    "tokens_reused": ("tokens_reused",
                                      "cached entries calls attended to without recomputing"),
                    "predd_requests": ("requests", "requests predd answered"),
                    "predd_errors": ("errors", "requests predd answered with an error"),
                    "batch_picks_failed": ("batch_picks_failed",
                                           "batched token picks of a step that raised, "
                                           "their calls then picked one by one"),
                    "answered_in_flight": ("answered_in_flight",
                                           "requests predd answered while a step's pass "
                                           "ran on the device")}
        for name, (key, doc) in counters.items():
            yield CounterMetricFamily(f"symphony_{name}", doc, value=s.get(key, 0))
        for name, key, doc in (
                ("symphony_queue_wait_seconds", "queue_wait_hist",
                 "time a call waited from arrival to its first step"),
                ("symphony_step_seconds", "step_hist", "forward pass time")):
            h = s.get(key)
            if h:
                yield _histogram(name, doc, h)
        tiers = GaugeMetricFamily("symphony_kv_tier_pages", "KV pages per memory tier, "
                                  "total and used", labels=["tier", "state"])
        for tier, figures in (s.get("tiers") or {}).items():
            tiers.add_metric([tier, "total"], figures.get("pages_total", 0))
            tiers.add_metric([tier, "used"], figures.get("pages_used", 0))
        yield tiers
        moved = CounterMetricFamily("symphony_kv_pages_moved", "KV pages moved between "
                                    "tiers, down (evicted) or up (brought back)",
                                    labels=["direction"])
        moved.add_metric(["down"], s.get("pages_moved_down", 0))
        moved.add_metric(["up"], s.get("pages_moved_up", 0))
        yield moved
        yield CounterMetricFamily("symphony_kv_bytes_moved", "bytes of K/V copied between "
                                  "tiers", value=s.get("bytes_moved", 0))
        yield CounterMetricFamily("symphony_admission_waits", "calls that waited for room "
                                  "on the device", value=s.get("admission_waits", 0))
        spec = CounterMetricFamily("symphony_speculation", "speculative continuation: next "
                                   "steps queued before a pred_sample loop asked, taken, "
                                   "discarded, and tokens computed for discarded ones",
                                   labels=["outcome"])
        for outcome, n in (s.get("speculation") or {}).items():
            spec.add_metric([outcome], n)
        yield spec
        rows = CounterMetricFamily("symphony_logits_rows", "raw pred rows by the way they "
                                   "went back: the session's logits buffer or a frame",
                                   labels=["via"])
        for via, n in (s.get("logits_rows") or {}).items():
            rows.add_metric([via], n)
        yield rows
        yield CounterMetricFamily("symphony_launch_wait_seconds",
                                  "time predd held a step for more calls (adaptive launch)",
                                  value=s.get("launch_wait_ms", 0.0) / 1e3)


    def _replicas(self, answers):
        up = GaugeMetricFamily("symphony_replica_up", "the replica's predd answered this "
                               "scrape", labels=["replica"])
        runs = GaugeMetricFamily("symphony_replica_runs", "runs and OpenAI requests in "
                                 "flight on the replica", labels=["replica"])
        for r, one in answers:
            up.add_metric([r.addr], int(one is not None))
            runs.add_metric([r.addr], r.inflight)
        yield up
        yield runs
        if self.mount:
            count, size = read_migrations(self.mount)
            yield CounterMetricFamily("symphony_kv_migrations", "cache files kvfsd moved "
                                      "between replicas", value=count)
            yield CounterMetricFamily("symphony_kv_migrated_bytes", "bytes of the caches "
                                      "kvfsd moved between replicas", value=size)


def _histogram(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    """A Prometheus histogram from predd's cumulative bucket counts (in ms)."""
    buckets = [(f"{le / 1e3:g}", n) for le, n in zip(h["le_ms"], h["cumulative"])]
    buckets.append(("+Inf", h["cumulative"][-1]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum_ms"] / 1e3)


class Metrics:
    def __init__(self, replicas=None, mount: str | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.http = Counter("symphony_http_requests", "HTTP requests, by route template, "
                            "method and status", ["route", "method", "status"], registry=r)
        self.errors = Counter("symphony_errors", "errors answered, by errno name",
                              ["errno"], registry=r)
        self.runs_active = Gauge("symphony_runs_active", "program runs going, by program",
                                 ["program"], registry=r)
        self.runs_finished = Counter("symphony_runs_finished", "program runs ended, by "
                                     "program", ["program"], registry=r)
        self.runs_failed = Counter("symphony_runs_failed", "program runs that ended other "
                                   "than with status 0 (killed, failed, non-zero)",
                                   ["program"], registry=r)
        self.openai_tokens = Counter("symphony_openai_tokens", "OpenAI API tokens, by kind "
                                     "(prompt, cached, completion)", ["kind"], registry=r)
        self.openai_queue = Histogram("symphony_openai_queue_wait_seconds", "per OpenAI "
                                      "request: time its predd calls waited for a step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.openai_step = Histogram("symphony_openai_step_seconds", "per OpenAI request: "
                                     "forward-pass time of its predd calls",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.openai_latency = Histogram("symphony_openai_request_seconds", "per OpenAI "
                                        "request: time from arrival to its last byte",
                                        buckets=LATENCY_BUCKETS, registry=r)
        r.register(PreddCollector(replicas, mount))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def run_started(self, program: str) -> None:
        self.runs_active.labels(program).inc()

    def run_ended(self, program: str, ok: bool) -> None:
        self.runs_active.labels(program).dec()
        self.runs_finished.labels(program).inc()
        if not ok:
            self.runs_failed.labels(program).inc()

    def openai_done(self, usage: dict, cost: dict, seconds: float) -> None:
        self.openai_tokens.labels("prompt").inc(usage.get("prompt_tokens", 0))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.openai_tokens.labels("cached").inc(cached)
        self.openai_tokens.labels("completion").inc(usage.get("completion_tokens", 0))
        if cost:
            self.openai_queue.observe(cost.get("queue_ms", 0.0) / 1e3)
            self.openai_step.observe(cost.get("step_ms", 0.0) / 1e3)
        self.openai_latency.observe(seconds)
