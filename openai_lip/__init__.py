"""openai_lip: the OpenAI API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`)
as a LIP — an ordinary program that answers with liblip's system calls only.

It runs as its own process, `python -m openai_lip` (server.py has the JSON-line
messages it reads and writes); `symphony serve` starts it sandboxed and puts HTTP in
front of it (gatewayd/openai_bridge.py, gatewayd/openai_api.py). It owns the requests'
checking (requests.py), decoding (decode.py), response bodies (format.py), its prefix
cache kept as files in the KV file system (prefix_cache.py) and the vocabulary that
JSON schemas need (vocab.py).

May import: liblip, symphony_protocol, numpy, gguf and llguidance; never gatewayd, predd
or kvfsd: it holds no server state, and anything it knows comes through liblip's calls.
"""
