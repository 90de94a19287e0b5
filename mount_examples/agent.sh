#!/bin/sh
# agent.sh — an agent loop in plain sh: try, check, retry from a fork.
#
# The conversation is a cache file. For each step the agent forks it with `cp` (O(1):
# the fork shares every page), lets the model answer in the fork (`lip chat`), and runs
# a checker on the reply — any shell command: a test suite, a linter, a grep. An
# accepted fork replaces the conversation (`mv`); a rejected one is removed (`rm`) and
# the step is tried again from the same point, with the checker's words as feedback.
# The history is never computed twice: every try starts from the cached conversation
# and computes only its own turn (a new conversation's first turn includes the chat
# template's system prompt).
#
#   agent.sh FILE.kv TASK [NEXT-MESSAGE...]
#   AGENT_CHECK='grep -qi paris'   checker; reads the reply on stdin (default: non-empty)
#   AGENT_TRIES=3                  tries per step
#   AGENT_MAX_TOKENS=64            reply length
# FILE is relative to the current directory inside the KV file system, else to
# $KVFS_MOUNT (as for `lip`). Progress goes to stderr, replies to stdout.
set -eu

usage() { echo "usage: agent.sh FILE.kv TASK [NEXT-MESSAGE...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
lip=${LIP:-lip}
check=${AGENT_CHECK:-grep -q .}
tries=${AGENT_TRIES:-3}
max_tokens=${AGENT_MAX_TOKENS:-64}

mount=$(cd "${KVFS_MOUNT:-/mnt/kvfs}" && pwd -P)
case $1 in
    /*) file=$1 ;;
    *) case $(pwd -P)/ in "$mount"/*) file=$(pwd -P)/$1 ;; *) file=$mount/$1 ;; esac ;;
esac
shift
try="$file.try"
trap 'rm -f "$try"' EXIT
tokens() { getfattr --absolute-names --only-values -n user.kv.tokens "$1"; }

[ -e "$file" ] || touch "$file"            # a new, empty conversation
step=0
for message in "$@"; do
    step=$((step + 1))
    prompt=$message
    n=1
    while :; do
        cp "$file" "$try"                  # fork the conversation
        before=$(tokens "$try")
        if [ "$n" -eq 1 ]; then            # greedy first, then seeded samples
            reply=$("$lip" chat "$try" "$prompt" --max-tokens "$max_tokens")
        else
            reply=$("$lip" chat "$try" "$prompt" --max-tokens "$max_tokens" \
                    --temperature 0.8 --seed "$n")
        fi
        added=$(( $(tokens "$try") - before ))
        if verdict=$(printf '%s\n' "$reply" | sh -c "$check" 2>&1); then
            mv "$try" "$file"              # accept: the fork becomes the conversation
            echo "agent.sh: step $step try $n accepted (+$added tokens)" >&2
            printf '%s\n' "$reply"
            break
        fi
        rm "$try"                          # reject: free the fork, keep the history
        echo "agent.sh: step $step try $n rejected (+$added tokens): $verdict" >&2
        if [ "$n" -ge "$tries" ]; then
            echo "agent.sh: step $step: no accepted reply in $tries tries" >&2
            exit 1
        fi
        n=$((n + 1))
        prompt="$message (An earlier answer was rejected: ${verdict:-no reason given}.)"
    done
done
