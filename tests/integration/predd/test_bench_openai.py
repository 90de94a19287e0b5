"""scripts/bench_openai.py's own way in: the OpenAI program (`python -m openai_lip`) over
its JSON lines beside the shared real predd, no gateway and no mount (the GPU loop
check's, scripts/gpu_check.sh loop), and its baseline, the same requests through
predd's generate from threads. Its HTTP way in is tested against a real `symphony
serve` in tests/integration/gatewayd/test_openai.py."""
from types import SimpleNamespace

from scripts.bench_openai import Generate, Program, run


def test_the_program_answers_every_request_with_every_token_asked(predd):
    program = Program(predd.addr, None)
    try:
        args = SimpleNamespace(num_prompts=5, input_len=20, output_len=6, concurrency=3)
        got = run(program.complete, program.model, args)
    finally:
        program.close()
    assert (got["completed"], got["failed"], got["total_output_tokens"]) == (5, 0, 30)
    assert got["errors"] == [] and got["median_tpot_ms"] > 0 and got["mean_ttft_ms"] > 0
    assert program.proc.returncode == 0        # stdin closed: it ended on its own


def test_the_generate_baseline_answers_the_same_requests_with_every_token(predd):
    baseline = Generate(predd.addr)
    try:
        args = SimpleNamespace(num_prompts=5, input_len=20, output_len=6, concurrency=3)
        got = run(baseline.complete, "model", args, seed=1)
    finally:
        baseline.close()
    assert (got["completed"], got["failed"], got["total_output_tokens"]) == (5, 0, 30)
    assert got["errors"] == [] and got["median_tpot_ms"] > 0 and got["mean_ttft_ms"] > 0
