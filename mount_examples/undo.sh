#!/bin/sh
# undo.sh — chat with a cache file and take back the last turn (Ctrl+Z or "/undo").
#
# Before each turn the conversation is forked with `cp` (O(1): the fork shares every
# page) into a hidden sibling, FILE.undo; undo is `mv FILE.undo FILE`. The old state is
# kept only briefly: the next turn replaces it, and after UNDO_SECONDS (default 120) it
# is removed instead of restored.
#
#   undo.sh FILE.kv MESSAGE|/undo ...    each argument is one turn, or an undo
#   undo.sh FILE.kv                      interactive: one message per line; Ctrl+Z or
#                                        a line "/undo" undoes; end of input quits
# FILE is relative to the current directory inside the KV file system, else to
# $KVFS_MOUNT (as for `lip`). LIP_ARGS is passed to `lip chat` (e.g. --max-tokens 32).
set -u

[ $# -ge 1 ] || { echo "usage: undo.sh FILE.kv [MESSAGE|/undo ...]" >&2; exit 2; }
lip=${LIP:-lip}
keep=${UNDO_SECONDS:-120}
mount=$(cd "${KVFS_MOUNT:-/mnt/kvfs}" && pwd -P)
case $1 in
    /*) file=$1 ;;
    *) case $(pwd -P)/ in "$mount"/*) file=$(pwd -P)/$1 ;; *) file=$mount/$1 ;; esac ;;
esac
shift
dir=$(dirname "$file")
undo="$dir/.$(basename "$file").undo"
taken=0                                    # when $undo was taken (seconds since epoch)

say() { echo "undo.sh: $*" >&2; }

turn() {
    [ -e "$file" ] || touch "$file"
    cp "$file" "$undo" && taken=$(date +%s)   # the state before this turn, O(1)
    trap '' TSTP                              # `lip chat` (and we) ignore Ctrl+Z meanwhile
    # shellcheck disable=SC2086
    "$lip" chat "$file" "$1" ${LIP_ARGS:-}
    trap 'wants_undo=1' TSTP
}

undo() {
    if [ ! -e "$undo" ]; then
        say "nothing to undo"
    elif [ $(( $(date +%s) - taken )) -gt "$keep" ]; then
        rm -f "$undo"
        say "the previous state was kept ${keep}s only; nothing to undo"
    else
        mv "$undo" "$file"                    # the fork becomes the conversation again
        say "undone: $(basename "$file") is back as it was before the last turn"
    fi
}

wants_undo=0
trap 'wants_undo=1' TSTP
trap 'rm -f "$undo"' EXIT

if [ $# -gt 0 ]; then
    for message in "$@"; do
        if [ "$message" = /undo ]; then undo; else turn "$message"; fi
    done
    exit 0
fi

[ -t 0 ] && say "type a message; Ctrl+Z or /undo takes back the last turn; Ctrl+D quits"
while :; do
    [ -t 0 ] && printf '> ' >&2
    # waiting for a line, Ctrl+Z undoes at once: in the trap, which runs before `read`
    # blocks where the signal comes first (a flag checked before `read` would leave a
    # moment in which a Ctrl+Z waits for the next line), or interrupts it
    interrupted=0
    trap 'interrupted=1; undo' TSTP
    [ "$wants_undo" -eq 1 ] && { wants_undo=0; undo; }   # one that came before the trap
    if IFS= read -r line; then
        trap 'wants_undo=1' TSTP
        case $line in
            /undo) undo ;;
            "") ;;
            *) turn "$line" ;;
        esac
    elif [ "$interrupted" -eq 0 ]; then
        break                                 # end of input
    fi
    trap 'wants_undo=1' TSTP
    [ "$wants_undo" -eq 1 ] && { wants_undo=0; undo; }
    [ -t 0 ] || say "ready"
done
