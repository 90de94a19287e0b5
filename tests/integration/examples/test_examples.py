"""The paper's programs (mount_examples/) as real processes against a real predd (and a
real KV file system where they use one): each does what it claims, proved by exact
tokens, exact cost figures and exact file-system state."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from tests.integration.examples_fixtures import EXAMPLES, LineReader, example_env, run_example
from tests.integration.kvfs_fixtures import sh


def greedy_reference(lip, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """predd's own generate loop, one fresh cache per prompt (threads, so they batch)."""
    out: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        kv = lip.kv_create()
        out[i] = lip.generate(kv, prompts[i], max_tokens=max_tokens)
        lip.kv_close(kv)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def computed(lip) -> int:
    return lip.stats()["tokens_computed"]


def pages_free(lip) -> int:
    return lip.stats()["pages_free"]


# ---------------------------------------------------------------- 1. basic decoding

@pytest.mark.slow
def test_basic_decoding_is_greedy_generate(lip, tmp_path):
    n = 16
    proc, r = run_example("basic_decoding.py", "Write a haiku about caches.",
                          "--max-tokens", str(n), report=str(tmp_path / "r.json"))
    prompt = lip.chat_template([{"role": "user", "content": "Write a haiku about caches."}])
    assert r["prompt"] == prompt
    expected = greedy_reference(lip, [prompt], n)[0]
    assert r["tokens"] == expected
    eos = set(lip.info()["eos_ids"])
    body = [t for t in expected if t not in eos]
    assert proc.stdout == lip.detokenize(body, skip_special=True) + "\n"
    # as generate leaves it: every token but the last one fed
    assert r["cache_tokens"] == len(prompt) + len(expected) - 1


# ---------------------------------------------------------------- 2. prefix + parallel

QUESTIONS = ["What is a cache?", "Why fork a process?", "What does rm do?"]


@pytest.mark.slow
def test_prefix_parallel_computes_the_system_prompt_once(kvfs, lip, tmp_path):
    n = 8
    before = computed(lip)
    _, first = run_example("prefix_parallel.py", *QUESTIONS, "--max-tokens", str(n),
                           report=str(tmp_path / "1.json"))
    spent = computed(lip) - before
    s = first["system_tokens"]
    assert first["system_computed"] == s        # the first run prepared sys_msg.kv
    assert int(os.getxattr(kvfs.path("sys_msg.kv"), "user.kv.tokens")) == s
    for prompt, a in zip(first["prompts"], first["answers"]):
        # each question reuses the whole system prompt and computes only its own part
        assert a["first_cost"]["reused"] == s
        assert a["first_cost"]["computed"] == len(prompt) - s
        assert a["computed"] == len(prompt) - s + len(a["tokens"]) - 1
    assert spent == s + sum(a["computed"] for a in first["answers"])
    # same tokens as each question alone with the full prompt
    assert [a["tokens"] for a in first["answers"]] == greedy_reference(lip, first["prompts"], n)

    # A second process opens the file: the system prompt is not computed at all.
    before = computed(lip)
    _, again = run_example("prefix_parallel.py", QUESTIONS[0], "--max-tokens", str(n),
                           report=str(tmp_path / "2.json"))
    assert again["system_computed"] == 0
    assert computed(lip) - before == again["answers"][0]["computed"]
    assert again["answers"][0]["first_cost"]["reused"] == s
    assert again["answers"][0]["tokens"] == first["answers"][0]["tokens"]


@pytest.mark.slow
def test_prefix_parallel_without_kvfs(lip, tmp_path):
    _, r = run_example("prefix_parallel.py", *QUESTIONS[:2], "--no-kvfs", "--max-tokens", "2",
                       report=str(tmp_path / "r.json"))
    assert r["system_computed"] == r["system_tokens"]
    assert [a["first_cost"]["reused"] for a in r["answers"]] == [r["system_tokens"]] * 2


# ---------------------------------------------------------------- 3. beam search

def hf_beam_search(hf_model, prompt: list[int], width: int, steps: int, eos: set[int]):
    """The same beam search over transformers' logits, recomputed from scratch."""
    live, done = [([], 0.0)], []
    for _ in range(steps):
        cands = []
        for tokens, score in live:
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + tokens])).logits[0, -1]
            lp = torch.log_softmax(logits.float(), -1)
            top = torch.topk(lp, width)
            cands += [(score + float(v), tokens + [int(t)])
                      for v, t in zip(top.values, top.indices)]
        cands.sort(key=lambda c: -c[0])
        kept = cands[:width]
        done += [(t, s) for s, t in kept if t[-1] in eos]
        live = [(t, s) for s, t in kept if t[-1] not in eos]
        if not live:
            break
    return done + live


@pytest.mark.slow
def test_beam_search_matches_a_reference_and_frees_pruned_beams(lip, hf_model, tmp_path):
    # a prompt whose beams finish early (at EOS) while others go on: live beams shrink
    # and grow back, and every count of caches follows
    prompt, width, steps = "Say only the word: yes", 3, 6
    free = pages_free(lip)
    _, r = run_example("beam_search.py", prompt, "--width", str(width),
                       "--max-tokens", str(steps), report=str(tmp_path / "r.json"))
    ref = hf_beam_search(hf_model, r["prompt"], width, steps, set(lip.info()["eos_ids"]))
    got = sorted((h["tokens"], h["score"]) for h in r["hypotheses"])
    want = sorted(ref)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert np.allclose([s for _, s in got], [s for _, s in want], atol=2e-3)
    best = max(want, key=lambda h: h[1] / len(h[0]))
    assert r["best"] == best[0]
    # a cache per live beam, no more: pruned and finished beams were closed at once
    for step in r["trace"]:
        assert step["objects"] == step["live"]
    assert r["objects_at_end"] == 0
    assert pages_free(lip) == free
    assert any(h["tokens"][-1] in lip.info()["eos_ids"] for h in r["hypotheses"])
    assert len({step["live"] for step in r["trace"]}) > 1


# ---------------------------------------------------------------- 4. constrained JSON

def validate(value, schema: dict, where: str = "$") -> None:
    """The subset of JSON Schema the example's schema uses (jsonschema isn't a dependency)."""
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in enum"
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), where
        assert set(schema.get("required", [])) <= set(value), f"{where}: missing keys"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), f"{where}: extra keys"
        for key, sub in schema["properties"].items():
            if key in value:
                validate(value[key], sub, f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list), where
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), where
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), where
        assert schema.get("minimum", -1 << 63) <= value <= schema.get("maximum", 1 << 63)
    elif kind == "boolean":
        assert isinstance(value, bool), where
    else:
        raise AssertionError(f"validator does not know type {kind}")


@pytest.mark.slow
def test_constrained_json_always_follows_the_schema(lip, tmp_path):
    pytest.importorskip("llguidance")
    runs = 20
    proc, r = run_example("constrained_json.py", "--runs", str(runs), "--seed", "0",
                          report=str(tmp_path / "r.json"))
    eos = set(lip.info()["eos_ids"])
    texts = []
    for run in r["runs"]:
        # complete: llguidance reports the grammar done (only EOS left to allow)
        assert run["complete"] and eos.isdisjoint(run["tokens"][:-1])
        validate(json.loads(run["text"]), r["schema"])
        texts.append(run["text"])
        # forced tokens ("age": ...) skip sampling: fewer calls than tokens
        assert run["forced"] > 0 and run["pred_calls"] + run["forced"] == len(run["tokens"])
    assert proc.stdout.splitlines() == texts
    assert len(set(texts)) >= runs // 2          # real sampling, not one canned answer


# ---------------------------------------------------------------- 5. speculative

REPEAT = ("Repeat the following text exactly, twice: The cache is a file. A fork is a "
          "copy. The cache is a file. A fork is a copy.")


@pytest.mark.slow
def test_speculative_decoding_is_greedy_in_fewer_calls(lip, tmp_path):
    n = 40
    proc, r = run_example("speculative.py", REPEAT, "--max-tokens", str(n),
                          report=str(tmp_path / "r.json"))
    expected = greedy_reference(lip, [r["prompt"]], n)[0]
    assert r["tokens"] == expected
    assert r["accepted"] > 0
    assert r["pred_calls"] + r["accepted"] == len(expected)   # one token a call, + drafts
    assert r["pred_calls"] <= len(expected) // 2
    assert r["cache_tokens"] == len(r["prompt"]) + len(expected) - 1   # tails truncated
    eos = set(lip.info()["eos_ids"])
    assert proc.stdout == lip.detokenize([t for t in expected if t not in eos],
                                         skip_special=True) + "\n"


# ---------------------------------------------------------------- 6. watermark

@pytest.mark.slow
def test_watermark_z_score_separates_marked_from_plain(lip, tmp_path):
    prompt = "Tell me something surprising."
    common = ["--runs", "20", "--delta", "4", "--max-tokens", "24", "--min-tokens", "24"]
    marked, plain = tmp_path / "marked", tmp_path / "plain"
    marked.mkdir()
    plain.mkdir()
    path = os.path.join(EXAMPLES, "watermark.py")
    procs = [subprocess.Popen([sys.executable, path, "generate", prompt, *common, "--seed", seed,
                               "--out", str(out), *extra], env=example_env(),
                              stderr=subprocess.PIPE, text=True)
             for seed, out, extra in (("0", marked, []), ("100", plain, ["--delta", "0"]))]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    files = sorted(str(f) for f in marked.iterdir()) + sorted(str(f) for f in plain.iterdir())
    assert len(files) == 40
    proc, _ = run_example("watermark.py", "detect", *files)
    z = {}
    for line in proc.stdout.splitlines():
        name, score, _, _ = line.split("\t")
        z[name] = float(score.removeprefix("z="))
    marked_z = [z[f] for f in files[:20]]
    plain_z = [z[f] for f in files[20:]]
    # Plain text's z is ~N(0, 1) whatever its length, so the largest of 20 is often
    # above 2 (p ~ 0.37); above 3 only with p ~ 0.03. Watermarked text is far beyond.
    assert min(marked_z) > 4, sorted(marked_z)
    assert max(plain_z) < 3, sorted(plain_z)


# ---------------------------------------------------------------- 7. ReAct

@pytest.mark.slow
def test_react_agent_runs_tools_on_the_same_cache(lip, tmp_path, example):
    react = example("react_agent")
    proc, r = run_example("react_agent.py", "What is 37 * 43?", report=str(tmp_path / "r.json"))
    assert r["turns"], "the agent must act at least once"
    for turn in r["turns"]:
        assert turn["tool"] in ("calc", "lookup")
        assert turn["observation"] == react.run_tool(turn["tool"], turn["arg"])
        assert f"Observation: {turn['observation']}\n" in r["transcript"]
        assert f"Observation: {turn['observation']}" in proc.stdout
        # the observation is appended in place: all the history reused, none recomputed
        assert turn["cost"]["reused"] == turn["context_before"] > r["prompt_tokens"]
    assert r["answer"] is not None and "Answer:" in proc.stdout
    first, rest = r["costs"][0], r["costs"][1:]
    assert first["reused"] == 0 and first["computed"] >= r["prompt_tokens"]
    assert all(c["reused"] > 0 for c in rest)
    # every token in the final cache was computed exactly once
    assert r["computed_total"] == r["cache_tokens"]


def test_react_tools(example):
    react = example("react_agent")
    assert react.calc("37 * 43") == "1591"
    assert react.calc("2 ** 10 - (3 + 1) / 2") == "1022.0"
    assert react.calc("__import__('os')").startswith("error")
    assert react.calc("9 ** 999").startswith("error")
    assert react.lookup("kvfsd", react.DOCS) == react.DOCS["kvfsd"]
    assert react.lookup("capital of France", react.DOCS) == react.DOCS["paris"]
    assert react.lookup("zebra", react.DOCS) == "no document found"


# ---------------------------------------------------------------- 8. tree of thought

@pytest.mark.slow
def test_tree_of_thought_merges_the_best_branch(lip, tmp_path):
    branches, answer_tokens = 4, 12
    _, r = run_example("tree_of_thought.py",
                       "A farmer has 3 pens with 4 sheep each. How many sheep are there?",
                       "--branches", str(branches), "--answer-tokens", str(answer_tokens),
                       report=str(tmp_path / "r.json"))
    assert len(r["branches"]) == branches
    scores = [b["score"] for b in r["branches"]]
    assert r["best"] == int(np.argmax(scores))
    assert len({tuple(b["tokens"]) for b in r["branches"]}) > 1   # seeds differ
    thought = r["branches"][r["best"]]["tokens"]
    assert r["merged_tokens"] == r["question"] + thought
    assert r["merged_positions"] == list(range(len(r["merged_tokens"])))
    # the answer reuses the whole merge, and equals decoding that text from scratch
    assert r["answer_cost"]["reused"] == len(r["merged_tokens"])
    assert r["answer_cost"]["computed"] == len(r["answer_prompt"])
    fresh = r["question"] + thought + r["answer_prompt"]
    assert r["answer"] == greedy_reference(lip, [fresh], answer_tokens)[0]


# ---------------------------------------------------------------- 9. RAG cache policy

RAG_QUERIES = [
    ("What is the capital of France?", "paris", "miss", []),
    ("How many people live in Tokyo?", "tokyo", "miss", []),
    ("Which museum is in Paris?", "paris", "hit", []),
    ("What does a KV cache store?", "kv", "miss", ["tokyo"]),    # tokyo: 1 hit < paris: 2
    ("Where is the Eiffel Tower?", "paris", "hit", []),
    ("What food is Tokyo known for?", "tokyo", "miss", ["kv"]),  # kv: 1 hit, older than paris
]


@pytest.mark.slow
def test_rag_cache_keeps_popular_documents_under_a_budget(kvfs, lip, tmp_path, example):
    rag = example("rag_cache")
    page, bpp = lip.info()["page_size"], lip.info()["bytes_per_page"]
    tokens = {d: len(rag.system_prefix(rag.system_for(rag.DOCS[d]))) for d in rag.DOCS}
    pages = {d: -(-n // page) for d, n in tokens.items()}
    budget = (pages["paris"] + pages["tokyo"]) * bpp      # room for two of the three
    assert pages["paris"] + pages["tokyo"] + pages["kv"] > pages["paris"] + pages["tokyo"]
    before = computed(lip)
    proc, r = run_example("rag_cache.py", *[q for q, *_ in RAG_QUERIES],
                          "--budget", str(budget), "--answer-tokens", "4",
                          report=str(tmp_path / "r.json"))
    spent = computed(lip) - before
    for (query, doc, outcome, evicted), got in zip(RAG_QUERIES, r["queries"]):
        assert (got["doc"], "hit" if got["hit"] else "miss", got["evicted"]) == \
            (doc, outcome, evicted), query
        assert got["doc_tokens"] == tokens[doc]
        assert got["doc_computed"] == (0 if got["hit"] else tokens[doc])
        assert got["first_cost"]["reused"] == tokens[doc]      # the document: never redone
        assert got["usage"] <= budget
    assert spent == sum(q["doc_computed"] + q["computed"] for q in r["queries"])
    # the file system agrees: what is left, what du counts, the program's own xattrs
    d = kvfs.path("rag")
    assert sorted(os.listdir(d)) == ["paris.kv", "tokyo.kv"]
    du = sh("du -B1 -c paris.kv tokyo.kv", cwd=d)
    assert int(du.stdout.splitlines()[-1].split()[0]) == r["queries"][-1]["usage"] == budget
    assert int(os.getxattr(os.path.join(d, "paris.kv"), "user.rag.hits")) == 3
    assert r["hits"] == {"paris": 3, "tokyo": 1}


# ---------------------------------------------------------------- 10. shell workflows

@pytest.mark.slow
def test_agent_sh_retries_from_a_fork(kvfs, lip, tmp_path):
    # the checker rejects the second reply it sees: step 2's first try
    counter = tmp_path / "checks"
    check = (f'n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter}; '
             f'[ $n -ne 2 ] || {{ echo "too vague"; exit 1; }}')
    env = example_env(AGENT_MAX_TOKENS="8", AGENT_CHECK=check)
    before = computed(lip)
    proc, _ = run_example("agent.sh", "conv.kv", "Name one use of a KV cache.",
                          "Say it in five words.", cwd=kvfs.mount, env=env)
    spent = computed(lip) - before
    log = proc.stderr.splitlines()
    assert [ln.split(" (")[0] for ln in log] == [
        "agent.sh: step 1 try 1 accepted", "agent.sh: step 2 try 1 rejected",
        "agent.sh: step 2 try 2 accepted"], log
    added = [int(ln.split("(+")[1].split()[0]) for ln in log]
    assert sorted(os.listdir(kvfs.mount)) == ["conv.kv"]        # the rejected fork is gone
    kv = lip.kv_open(kvfs.path("conv.kv"))
    final = lip.kv_tokens(kv)
    lip.kv_close(kv)
    assert len(final) == added[0] + added[2]
    text = lip.detokenize(final)
    assert text.count("Say it in five words.") == 1 and "rejected: too vague" in text
    # each try computed only its own turn: the history was forked, never recomputed
    assert spent == added[0] + added[1] + added[2]


@pytest.mark.slow
def test_undo_sh_restores_the_previous_cache_on_ctrl_z(kvfs, lip):
    proc = subprocess.Popen(["sh", os.path.join(EXAMPLES, "undo.sh"), "chat.kv"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=kvfs.mount,
                            env=example_env(LIP_ARGS="--max-tokens 4"))
    err = LineReader(proc.stderr)
    try:
        proc.stdin.write("Hi\n")
        proc.stdin.flush()
        err.wait_for("ready")
        kv = lip.kv_open(kvfs.path("chat.kv"))
        after_first = lip.kv_tokens(kv)
        lip.kv_close(kv)
        proc.stdin.write("Tell me a joke\n")
        proc.stdin.flush()
        err.wait_for("ready")
        undo = kvfs.path(".chat.kv.undo")
        assert int(os.getxattr(undo, "user.kv.tokens")) == len(after_first)
        assert int(os.getxattr(kvfs.path("chat.kv"), "user.kv.tokens")) > len(after_first)
        proc.send_signal(signal.SIGTSTP)                         # Ctrl+Z
        err.wait_for("undone")
        assert not os.path.exists(undo)
        kv = lip.kv_open(kvfs.path("chat.kv"))
        assert lip.kv_tokens(kv) == after_first
        lip.kv_close(kv)
        proc.stdin.write("/undo\n")                              # only one level kept
        proc.stdin.flush()
        err.wait_for("nothing to undo")
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert sorted(os.listdir(kvfs.mount)) == ["chat.kv"]
