#!/usr/bin/env bash
# The CUDA check of the flashinfer backend, as one short run on a GPU machine that
# cannot reach a package index (docs/architecture.md, "Attention backends").
#
#   bash scripts/gpu_check.sh prepare   # here: wheels and a cut model into .gpu/
#   bash scripts/gpu_check.sh run [OUT] # there, from the repo root, with .gpu/ carried
#   bash scripts/gpu_check.sh graphs [OUT]   # there: the CUDA graphs' checks and timings
#   bash scripts/gpu_check.sh buffer [OUT]   # there: bf16 graphs, the pred loop's buffer
#   bash scripts/gpu_check.sh loop [OUT]     # there: the loops and the OpenAI program on
#                                            # an 8B shape (LOOP_CPU=1: a rehearsal here)
#
# `prepare` downloads flashinfer-python (the version predd/attention/flashinfer_backend.py is
# written against) with the two packages such a machine lacks (apache-tvm-ffi for its
# bindings, pyzmq and gguf for predd), for CPython 3.12, and writes SmolLM2-135M cut to
# its first 4 layers (scripts/gguf_cut.py): the whole GGUF is 98 MB, over what one
# transfer carries beside the wheels. `run` installs the wheels into /tmp/site, then, each
# stage under its own time limit so that a slow JIT compile still leaves the others a
# report: the tests in tests/gpu in fp16 (kernels against the torch backend, greedy
# tokens of the model per backend, a serving predd); then, on the cut grown back to
# SmolLM2-135M's 30 layers (its shape and cost, not its weights), decode-step timings of
# the torch and flashinfer backends (scripts/bench_step.py) and a serving predd's
# generate throughput per backend (scripts/bench_completion.py, no baselines); the same
# steps on a random model of SmolLM2-1.7B's shape (scripts/gguf_random.py, written
# there); last the kernel test that needs another JIT compile (4 q heads a kv head).
# Everything goes to OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
FLASHINFER=flashinfer-python==0.6.18.post1
WHEELS=(apache-tvm-ffi==0.1.15.post2 pyzmq==27.3.0 gguf==0.19.0)
MODEL=.gpu/smollm2-4layers.gguf
WHOLE=.gpu/smollm2-135m-shape.gguf
PYTEST_STOP=(python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/gpu/test_flashinfer.py)

prepare() {
    local py=${VENV:-.venv}/bin/python
    mkdir -p .gpu/whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .gpu/whl "$FLASHINFER" "${WHEELS[@]}" || return
    [ -f "$MODEL" ] || "$py" scripts/gguf_cut.py "$MODEL" --layers 4 || return
    du -sh .gpu/whl "$MODEL"
}

grow_whole() {   # the 4-layer cut grown back to SmolLM2-135M's 30 layers (its shape and
                 # cost, not its weights), at $WHOLE
    stage "grow the cut to 30 layers" 30 python3 scripts/gguf_cut.py "$WHOLE" --layers 30 \
        --model "$MODEL"
}

stage() {   # stage NAME SECONDS COMMAND...: a heading, the command under a limit, its status
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS - t0))s"
}

setup() {   # setup OUT LOG: the log, the wheels, the environment
    mkdir -p "$1"
    exec > >(tee "$1/$2") 2>&1
    nvidia-smi -L; nvcc --version | tail -1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl || exit
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
    export SYMPHONY_GPU_MODEL=$PWD/$MODEL
    python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"
}

run() {
    setup "${1:-.gpu/out}" gpu_check.log
    local pytest=(python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flashinfer.py)
    stage "kernels, fp16, SmolLM2's shape (first JIT compile)" 240 \
        "${pytest[@]}" -k "smollm2-shape and fp16"
    stage "the model's greedy tokens per backend" 90 "${pytest[@]}" -k real_model
    stage "predd --attention flashinfer serving" 60 "${pytest[@]}" -k serves
    # The whole model's shape: the 4-layer cut grown back to 30 layers (blocks 0-3 in
    # turn), so each step costs what SmolLM2-135M's does; its tokens are not the model's.
    local whole=$WHOLE
    grow_whole
    steps "$whole" "1 512" "64 512" "8 8192"
    for backend in torch flashinfer; do
        SYMPHONY_BENCH_PREDD_ARGS="--device cuda --attention $backend --model $whole" \
            stage "serving, $backend: generate, 1/8/64 programs x 64 tokens" 90 \
            python3 scripts/bench_completion.py --programs 1,8,64 --as processes \
            --modes generate --baselines "" --repeat 1 --dtype float16
    done
    local large=/tmp/smollm2-1.7b-shape.gguf
    stage "write a random SmolLM2-1.7B-shaped model" 60 python3 scripts/gguf_random.py \
        "$large" --shape smollm2-1.7b --tokenizer "$MODEL"
    steps "$large" "1 512" "64 1024"
    stage "kernels, 4 q heads a kv head (tensor-core decode)" 240 "${pytest[@]}" -k "gqa4 and fp16"
}

# The decode step's CUDA graphs (predd/worker/cuda_graphs.py): graphs against eager steps (the
# model's logits, fp16 first, bf16 last: each dtype is a JIT compile), a serving predd
# with them, then the whole model's shape timed with graphs off and on: decode steps, a
# serving predd's generate and pred loop, a SmolLM2-1.7B-shaped step.
graphs() {
    setup "${1:-.gpu/out}" gpu_graphs.log
    local pytest=("${PYTEST_STOP[@]}")
    stage "graphs vs eager, flashinfer vs torch, fp16 (first JIT compile)" 240 \
        "${pytest[@]}" -k "(cuda_graphs and fp16) or real_model" -s
    stage "predd serving (flashinfer with graphs)" 90 "${pytest[@]}" -k serves
    local whole=$WHOLE
    grow_whole
    for shape in "1 512" "64 512"; do
        set -- $shape
        for g in off on; do
            stage "step: 135M shape, flashinfer, graphs $g, $1 calls x $2" 60 \
                python3 scripts/bench_step.py --device cuda --dtype float16 --model "$whole" \
                --attention flashinfer --cuda-graphs $g --calls "$1" --context "$2" --reps 20
        done
    done
    for g in off on; do
        SYMPHONY_BENCH_PREDD_ARGS="--device cuda --attention flashinfer --cuda-graphs $g --model $whole" \
            stage "serving, graphs $g: generate and pred loop, 1/8/64 programs x 64 tokens" 120 \
            python3 scripts/bench_completion.py --programs 1,8,64 --as processes \
            --modes generate,pred_loop --baselines "" --repeat 1 --dtype float16
    done
    local large=/tmp/smollm2-1.7b-shape.gguf
    stage "write a random SmolLM2-1.7B-shaped model" 60 python3 scripts/gguf_random.py \
        "$large" --shape smollm2-1.7b --tokenizer "$MODEL"
    for g in off on; do
        stage "step: 1.7B shape, flashinfer, graphs $g, 64 calls x 1024" 60 \
            python3 scripts/bench_step.py --device cuda --dtype float16 --model "$large" \
            --attention flashinfer --cuda-graphs $g --calls 64 --context 1024 --reps 20
    done
    [ "${GRAPHS_BF16:-1}" = 0 ] ||   # GRAPHS_BF16=0: not this one (a device lease is short)
        stage "graphs vs eager, bf16 (its JIT compile)" 200 "${pytest[@]}" -k "cuda_graphs and bf16" -s
}

# bf16 on the GPU (what `--dtype auto` picks there): the decode graphs against eager steps
# (the shared logits rows, the JIT compile of bf16), then a serving predd with graphs on,
# the whole model's shape: generate, the `pred` loop (rows through the logits buffer:
# each run's log line counts rows by the way they went back) and pred_sample, 1/8/64
# programs as processes and as threads.
buffer() {
    local out=${1:-.gpu/out}
    setup "$out" gpu_buffer.log
    local pytest=("${PYTEST_STOP[@]}")
    stage "graphs vs eager, bf16 (first JIT compile)" 240 \
        "${pytest[@]}" -k "cuda_graphs and bf16" -s
    local whole=$WHOLE
    grow_whole
    # each run's log line has predd's split of a step; the launch hold's trace (its
    # objects' return times and holds, scripts/hold_trace) goes to OUT/hold_trace.txt
    SYMPHONY_BENCH_PREDD_ARGS="--device cuda --attention flashinfer --cuda-graphs on --model $whole" \
        PYTHONPATH="$PYTHONPATH:$PWD/scripts/hold_trace" HOLD_TRACE="$out/hold_trace.txt" \
        stage "serving, bf16, graphs on: generate, pred loop, pred_sample" 240 \
        python3 scripts/bench_completion.py --programs 1,8,64 --as processes,threads \
        --modes generate,pred_loop,pred_sample --baselines "" --repeat 1 --dtype bfloat16
    cat "$out/hold_trace.txt"
}

# Programs at the device's speed (its figures go to docs/benchmarks.md, "GPU"): on
# Llama-3-8B's body cut to 8 layers (scripts/gguf_random.py, written there),
# bf16, flashinfer, graphs on, speculation at its default, generate against the `pred`
# loop and the `pred_sample` loop at 8 / 32 / 64 programs as processes, best of 2; then
# the OpenAI program itself at 32 requests in flight (scripts/bench_openai.py, over its
# JSON lines: the machine has neither FUSE nor the gateway's packages), and the same
# requests through predd's generate with no program between; first the test that a step's
# tokens picked on the device are the host's (tests/gpu/test_device_picks.py). LOOP_CPU=1
# rehearses the same stages here, on B6's tiny shape and the CPU.
loop() {
    local out=${1:-.gpu/out} shape=llama3-8b-8l dtype=bfloat16 py=python3
    local device="--device cuda --attention flashinfer --cuda-graphs on" tokenizer=$MODEL
    if [ "${LOOP_CPU:-0}" = 1 ]; then
        mkdir -p "$out"
        exec > >(tee "$out/gpu_loop.log") 2>&1
        shape=tiny dtype=auto py=${VENV:-.venv}/bin/python device="--device cpu" tokenizer=
    else
        setup "$out" gpu_loop.log
    fi
    local model=/tmp/$shape-random.gguf
    stage "a step's tokens picked on the device" 60 "$py" -m pytest -q -p no:cacheprovider \
        tests/gpu/test_device_picks.py
    stage "write the $shape shape" 120 "$py" scripts/gguf_random.py "$model" --shape "$shape" \
        ${tokenizer:+--tokenizer "$tokenizer"}
    SYMPHONY_BENCH_PREDD_ARGS="$device --model $model" \
        stage "$shape, $dtype: generate, pred loop, pred_sample at 8/32/64 programs" 300 \
        "$py" scripts/bench_completion.py --programs 8,32,64 --as processes \
        --modes generate,pred_loop,pred_sample --baselines "" --repeat 2 --dtype "$dtype"
    SYMPHONY_BENCH_PREDD_ARGS="$device --model $model --overlap off" \
        stage "$shape, $dtype: pred_sample at 64 programs, nothing answered in flight" 90 \
        "$py" scripts/bench_completion.py --programs 64 --as processes \
        --modes generate,pred_sample --baselines "" --repeat 1 --dtype "$dtype"
    SYMPHONY_BENCH_PREDD_ARGS="$device" \
        stage "$shape, $dtype: the OpenAI program, 64 prompts x 64 tokens, 32 in flight" 150 \
        "$py" scripts/bench_openai.py --model "$model" --dtype "$dtype" --num-prompts 64 \
        --concurrency 32
}

steps() {   # steps MODEL "CALLS CONTEXT"...: the decode step per backend, fp16, best of 20
    local model=$1; shift
    for shape in "$@"; do
        set -- $shape
        for backend in torch flashinfer; do
            stage "step: $(basename "$model"), $backend, $1 calls x $2 entries" 60 \
                python3 scripts/bench_step.py --device cuda --dtype float16 --model "$model" \
                --attention "$backend" --calls "$1" --context "$2" --reps 20
        done
    done
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    graphs) shift; graphs "$@" ;;
    buffer) shift; buffer "$@" ;;
    loop) shift; loop "$@" ;;
    *) echo "usage: $0 prepare | run [OUT] | graphs [OUT] | buffer [OUT] | loop [OUT]" >&2
       exit 2 ;;
esac
