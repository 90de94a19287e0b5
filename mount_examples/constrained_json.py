"""Structured output without a server feature: JSON that follows a schema.

The program runs llguidance itself to compute, before every token, the set of tokens
the schema allows, and hands it to predd as a bitmask with the call
(`pred_sample(kv, tokens, {...}, mask=bits)`): predd masks the logits and samples, so
only one int comes back per token. Where the grammar forces the next tokens
(`"age":` after `"name":"…",`), they are appended without sampling, in the next call.

llguidance needs the model's vocabulary as bytes. predd has no call that returns it
(its `detokenize` of a single byte-level token can't show half a UTF-8 character), so
the program reads the token table from the model's GGUF file with the `gguf` package
(plain Python + numpy, no torch) and uses predd's own `tokenize` for encoding
(`openai_lip/vocab.py`, which the OpenAI program uses for `response_format` too).

    python mount_examples/constrained_json.py [--runs 20] [--seed 0] [--temperature 1]
        [--schema FILE.json] [--model PATH.gguf]
"""
from __future__ import annotations

import argparse
import json
import random

import llguidance

import liblip as lip
from common import chat, eos_ids, fail, write_report
from liblip.threads import run_threads
from openai_lip.vocab import PreddTokenizer, default_model, gguf_vocab

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]},
                      "minItems": 1, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "admin"],
    "additionalProperties": False,
}
PROMPT = ("Describe a fictional programmer as a JSON object with their name, age, the "
          "languages they know and whether they are an admin.")


def load_tokenizer(model: str) -> llguidance.LLTokenizer:
    tokens = gguf_vocab(model)
    if len(tokens) != lip.info_cached()["vocab_size"]:
        fail(f"{model}: {len(tokens)} tokens, but predd serves {lip.info_cached()['vocab_size']}")
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(PreddTokenizer(tokens)),
                                  eos_token=sorted(eos_ids()))


def generate_json(tok: llguidance.LLTokenizer, grammar: str, prompt_kv: lip.KV,
                  last: int, seed: int, temperature: float, max_tokens: int) -> dict:
    """One constrained sample after the prompt (cached in `prompt_kv` but for its last
    token, `last`): its tokens, text and how many pred calls it took."""
    matcher = llguidance.LLMatcher(tok, grammar)
    rng = random.Random(seed)
    nbytes = (lip.info_cached()["vocab_size"] + 7) // 8
    kv = lip.kv_fork(prompt_kv)
    out: list[int] = []
    pending, calls, forced = [last], 0, 0
    try:
        while len(out) < max_tokens:
            mask = matcher.compute_bitmask()[:nbytes]
            s = lip.pred_sample(kv, pending, {"temperature": temperature,
                                              "seed": rng.getrandbits(31)}, mask=mask)
            calls += 1
            if not matcher.consume_token(s.token):
                raise RuntimeError(f"token {s.token} refused: {matcher.get_error()}")
            out.append(s.token)
            ff = [] if matcher.is_stopped() else matcher.compute_ff_tokens()
            if ff and not matcher.consume_tokens(ff):   # tokens the grammar forces
                raise RuntimeError(f"forced tokens refused: {matcher.get_error()}")
            out += ff
            forced += len(ff)
            if matcher.is_stopped():               # only EOS is left: the JSON is done
                break
            pending = [s.token] + ff
    finally:
        lip.kv_close(kv)
    text = lip.detokenize([t for t in out if t not in eos_ids()])
    return {"seed": seed, "tokens": out, "text": text, "pred_calls": calls,
            "forced": forced, "complete": matcher.is_stopped()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schema", help="a JSON schema file (default: a programmer record)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--runs", type=int, default=1, help="independent samples, in parallel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--model", help="the GGUF file predd serves (for its vocabulary)")
    ap.add_argument("--report")
    args = ap.parse_args()

    schema = json.load(open(args.schema)) if args.schema else SCHEMA
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    try:
        model = args.model or default_model()
    except FileNotFoundError as exc:
        fail(str(exc))
    tok = load_tokenizer(model)
    prompt = chat(args.prompt)
    prompt_kv = lip.kv_create()           # computed once, forked by every run
    lip.prefill(prompt_kv, prompt[:-1])
    results: list[dict] = [{} for _ in range(args.runs)]

    def run(i: int) -> None:
        results[i] = generate_json(tok, grammar, prompt_kv, prompt[-1], args.seed + i,
                                   args.temperature, args.max_tokens)

    run_threads(run, args.runs)
    lip.kv_close(prompt_kv)
    for r in results:
        lip.send_to_user(r["text"] + "\n")
    write_report(args.report, {"schema": schema, "runs": results})


if __name__ == "__main__":
    main()
