"""A minimal LIP for tests: greedy-decode N tokens after a prompt with a pred loop and
print the token ids as JSON. Usage: greedy.py PROMPT N [--generate]"""
import json
import sys

import liblip as lip

prompt, n = sys.argv[1], int(sys.argv[2])
kv = lip.kv_create()
tokens = lip.chat_template([{"role": "user", "content": prompt}])
if "--generate" in sys.argv:
    out = lip.generate(kv, tokens, max_tokens=n, ignore_eos=True)
else:
    dist = lip.pred(kv, tokens)
    out = []
    for _ in range(n):
        out.append(dist.argmax())
        dist = lip.pred(kv, [out[-1]])
print(json.dumps(out))
