"""A LIP for the gateway tests: holds a KV cache of N tokens, then echoes stdin lines
until `quit` or end of input.

    holder.py [N]      prints `holding P pages`, then `got: LINE` per line, then `bye`
"""
import sys

import liblip as lip

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    kv = lip.kv_create()
    lip.prefill(kv, list(range(100, 100 + n)))
    print(f"holding {lip.kv_stat(kv)['pages']} pages", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print(f"got: {line.strip()}", flush=True)
    print("bye", flush=True)
