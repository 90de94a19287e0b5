"""B6's --context: each program's prompt made exactly N tokens of its own."""
from scripts.bench_loop import long_prompts


def test_long_prompts_repeat_each_prompt_to_exactly_n_tokens():
    assert long_prompts([[1, 2, 3], [7]], 7) == [[1, 2, 3, 1, 2, 3, 1], [7] * 7]
    assert long_prompts([[1, 2, 3]], 2) == [[1, 2]]
