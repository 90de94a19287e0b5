"""scripts/bench_openai.py's reading of a stream and its figures (the two ways in run
against a real server in tests/integration/gatewayd/test_openai.py and
tests/integration/predd/test_bench_openai.py)."""
import math

from scripts.bench_openai import Outcome, _sse, prompts, read_events, summary


def chunk(text=None, usage=None):
    c = {"choices": [] if text is None else [{"index": 0, "text": text}]}
    if usage:
        c["usage"] = usage
    return c


def test_ttft_is_the_first_nonempty_text_and_tokens_come_from_the_last_usage():
    clock = iter([10.5, 11.0]).__next__
    events = [chunk(""), chunk("a"), chunk("b"), chunk(None, {"completion_tokens": 5})]
    got = read_events(events, clock, 10.0)
    assert got == Outcome(True, ttft=0.5, latency=1.0, tokens=5)


def test_a_stream_without_usage_is_a_failure():
    clock = iter([1.0, 2.0]).__next__
    assert read_events([chunk("a")], clock, 0.0) == Outcome(False, error="no usage in the stream")


def test_sse_reads_data_lines_to_done_and_skips_the_rest():
    lines = [b": keep-alive\n", b"data: {\"x\": 1}\n", b"\n", b"data:{\"x\": 2}\r\n",
             b"data: [DONE]\n", b"data: {\"x\": 3}\n"]
    assert list(_sse(lines)) == [{"x": 1}, {"x": 2}]


def test_summary_takes_vllms_definitions_over_completed_requests():
    got = summary([Outcome(True, 0.1, 1.1, 11), Outcome(True, 0.3, 0.3, 1),
                   Outcome(True, 0.2, 2.2, 5), Outcome(False, error="HTTP 503")], 2.0)
    assert (got["completed"], got["failed"], got["total_output_tokens"]) == (3, 1, 17)
    assert got["output_throughput"] == 8.5
    assert math.isclose(got["median_tpot_ms"], 300.0)     # of 100 and 500 (1 token: none)
    assert math.isclose(got["mean_ttft_ms"], 200.0)
    assert got["errors"] == ["HTTP 503"]


def test_prompts_are_seeded_ids_of_the_asked_length_and_no_special_token():
    a, b = prompts(3, 7), prompts(3, 7)
    assert a == b and [len(p) for p in a] == [7, 7, 7]
    assert all(1000 <= t < 30000 for p in a for t in p) and a[0] != a[1]
