#!/usr/bin/env bash
# `make demo`: predd (CPU, SmolLM2-135M) and kvfsd on a private mount; the paper's
# prefix-cache + parallel-decoding LIP; the shell workflows (cp forks, lip chat, undo);
# a look at the mount with ls/du/df/getfattr; then everything stops and unmounts —
# also when interrupted halfway (the trap below cleans up).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
export PATH="$ROOT/$VENV/bin:$PATH"
PY="$ROOT/$VENV/bin/python"

RUN=$(mktemp -d /tmp/symphony-demo.XXXXXX)
MNT=$RUN/kvfs
mkdir -p "$MNT"
export SYMPHONY_RUNDIR=$RUN PREDD_ADDR="ipc://$RUN/predd.sock" KVFS_MOUNT=$MNT
PREDD_PID= KVFSD_PID= TAIL_PID= INTERRUPTED=

cleanup() {
    local code=$?
    trap - EXIT INT TERM
    cd "$ROOT"
    if [ -n "$TAIL_PID" ]; then kill "$TAIL_PID" 2>/dev/null || true; fi
    if [ -n "$KVFSD_PID" ] && kill -0 "$KVFSD_PID" 2>/dev/null; then
        kill -TERM "$KVFSD_PID" 2>/dev/null || true
        wait "$KVFSD_PID" 2>/dev/null || true
    fi
    if grep -qs " $MNT " /proc/mounts; then fusermount3 -u -z "$MNT" || true; fi
    if [ -n "$PREDD_PID" ] && kill -0 "$PREDD_PID" 2>/dev/null; then
        kill -TERM "$PREDD_PID" 2>/dev/null || true
        wait "$PREDD_PID" 2>/dev/null || true
    fi
    rm -rf "$RUN"
    if [ -n "$INTERRUPTED" ]; then
        echo "demo: interrupted; daemons stopped and $MNT unmounted" >&2
        code=0   # a requested stop that cleaned up is a clean exit
    elif [ "$code" -eq 0 ]; then echo; echo "== demo done: daemons stopped, $MNT unmounted"
    else echo "demo: failed (exit $code); daemons stopped and unmounted" >&2; fi
    exit "$code"
}
trap cleanup EXIT
trap 'INTERRUPTED=1; exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }

wait_ready() {   # FILE PID WHAT LOG
    local deadline=$((SECONDS + 180))
    until grep -q '^ready ' "$1" 2>/dev/null; do
        if ! kill -0 "$2" 2>/dev/null; then echo "demo: $3 failed:" >&2; tail -20 "$4" >&2; exit 1; fi
        if [ $SECONDS -ge $deadline ]; then echo "demo: $3 not ready in 180 s" >&2; exit 1; fi
        sleep 0.2
    done
}

step "starting predd (CPU, SmolLM2-135M-Instruct) at $PREDD_ADDR"
"$PY" -m predd --rundir "$RUN" >"$RUN/predd.out" 2>"$RUN/predd.log" &
PREDD_PID=$!
tail -n +1 -f "$RUN/predd.log" 2>/dev/null | sed -u 's/^/   /' &   # model-load progress
TAIL_PID=$!
wait_ready "$RUN/predd.out" "$PREDD_PID" predd "$RUN/predd.log"
sleep 0.2; kill "$TAIL_PID" 2>/dev/null || true; wait "$TAIL_PID" 2>/dev/null || true; TAIL_PID=
cat "$RUN/predd.out"

step "starting kvfsd on $MNT"
"$PY" -m kvfsd "$MNT" --predd "$PREDD_ADDR" --state "$RUN/state" >"$RUN/kvfsd.out" 2>"$RUN/kvfsd.log" &
KVFSD_PID=$!
wait_ready "$RUN/kvfsd.out" "$KVFSD_PID" kvfsd "$RUN/kvfsd.log"
cat "$RUN/kvfsd.out"

step "program 2: prefix caching + parallel decoding (mount_examples/prefix_parallel.py)"
echo "   sys_msg.kv is prefilled once as a file; each question forks it in its own thread"
"$PY" mount_examples/prefix_parallel.py \
    "What is a KV cache?" \
    "Why fork a cache instead of copying it?" \
    "What does a page pool do?" \
    --max-tokens 40 --report "$RUN/report.json"
"$PY" - "$RUN/report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
reused = sorted({a["first_cost"]["reused"] for a in r["answers"]})
print(f"   system prompt: {r['system_tokens']} tokens, computed once ({r['system_computed']}); "
      f"each question's first pred reused {reused} cached tokens")
EOF

step "workflow 10: a shell agent (cp forks + lip chat) and undo with mv"
cd "$MNT"
sh "$ROOT/mount_examples/agent.sh" demo-agent.kv "Name one use of a KV cache." "Say it in five words."
LIP_ARGS="--max-tokens 24" sh "$ROOT/mount_examples/undo.sh" demo-undo.kv "Hi" "Tell me a joke" /undo </dev/null
cd "$ROOT"

step "the KV file system: ls -l, du -h, df -h, getfattr -d"
cd "$MNT"
echo "\$ ls -l"; ls -l
echo "\$ du -h *.kv"; du -h ./*.kv
echo "\$ df -h ."; df -h .
echo "\$ cp sys_msg.kv fork.kv && du -h sys_msg.kv fork.kv   # a fork shares pages"
cp sys_msg.kv fork.kv && du -h sys_msg.kv fork.kv
echo "\$ getfattr -d sys_msg.kv"; getfattr -d sys_msg.kv
echo "\$ cat sys_msg.kv   # the descriptor: a fresh capability for this open"
sed 's/^cap .*/cap <128-bit capability, not shown>/' sys_msg.kv
cd "$ROOT"

step "predd's figures (lip stats)"
lip stats | grep -E '"(steps|calls|mean_batch|tokens_computed|tokens_reused|pages_total|pages_free)"'
lip fsck | grep '"clean"'
