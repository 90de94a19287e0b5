#!/usr/bin/env bash
# The CUDA check of the flashinfer backend, as one short run on a GPU machine that
# cannot reach a package index (docs/architecture.md, "Attention backends").
#
#   bash scripts/gpu_check.sh prepare   # here: wheels and a cut model into .gpu/
#   bash scripts/gpu_check.sh run [OUT] # there, from the repo root, with .gpu/ carried
#
# `prepare` downloads flashinfer-python (the version predd/attention_flashinfer.py is
# written against) with the two packages such a machine lacks (apache-tvm-ffi for its
# bindings, pyzmq and gguf for predd), for CPython 3.12, and writes SmolLM2-135M cut to
# its first 4 layers (scripts/gguf_cut.py): the whole GGUF is 98 MB, over what one
# transfer carries beside the wheels. `run` installs the wheels into /tmp/site, then, each
# stage under its own time limit so that a slow JIT compile still leaves the others a
# report: the tests in tests/gpu in fp16 (kernels against the torch backend, greedy
# tokens of the model per backend, a serving predd), decode-step timings of the torch
# and flashinfer backends (scripts/bench_step.py), then the kernel tests that need
# other JIT compiles (bf16, 4 q heads a kv head). Everything goes to OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
FLASHINFER=flashinfer-python==0.6.18.post1
WHEELS=(apache-tvm-ffi==0.1.15.post2 pyzmq==27.3.0 gguf==0.19.0)
MODEL=.gpu/smollm2-4layers.gguf

prepare() {
    local py=${VENV:-.venv}/bin/python
    mkdir -p .gpu/whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .gpu/whl "$FLASHINFER" "${WHEELS[@]}" || return
    [ -f "$MODEL" ] || "$py" scripts/gguf_cut.py "$MODEL" --layers 4 || return
    du -sh .gpu/whl "$MODEL"
}

stage() {   # stage NAME SECONDS COMMAND...: a heading, the command under a limit, its status
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS - t0))s"
}

run() {
    local out=${1:-.gpu/out}
    mkdir -p "$out"
    exec > >(tee "$out/gpu_check.log") 2>&1
    nvidia-smi -L; nvcc --version | tail -1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl || exit
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
    export SYMPHONY_GPU_MODEL=$PWD/$MODEL
    python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"
    local pytest=(python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flashinfer.py)
    stage "kernels, fp16, SmolLM2's shape (first JIT compile)" 240 \
        "${pytest[@]}" -k "smollm2-shape and fp16"
    stage "the model's greedy tokens per backend" 120 "${pytest[@]}" -k real_model
    stage "predd --attention flashinfer serving" 120 "${pytest[@]}" -k serves
    for shape in "1 512" "32 1024" "8 8192"; do
        set -- $shape
        for backend in torch flashinfer; do
            stage "step: $backend, $1 calls x $2 entries" 60 python3 scripts/bench_step.py \
                --device cuda --dtype float16 --model "$SYMPHONY_GPU_MODEL" \
                --attention "$backend" --calls "$1" --context "$2" --reps 20
        done
    done
    stage "kernels, bf16, SmolLM2's shape" 180 "${pytest[@]}" -k "smollm2-shape and bf16"
    stage "kernels, 4 q heads a kv head (tensor-core decode)" 240 "${pytest[@]}" -k gqa4
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 prepare | run [OUT]" >&2; exit 2 ;;
esac
