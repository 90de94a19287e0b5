"""predd: the pred daemon — the model, the paged KV memory and the step loop, behind a
ZeroMQ socket.

Its packages, by layer (each says what it owns and may import):
  server/     the ZeroMQ loop, sessions, identity, capabilities, quotas, request limits,
              the request handlers, the logits buffer, launching predd
  engine/     the step loop: intake of requests, calls, the scheduler, chunks, outputs,
              sampling, held changes, metrics
  memory/     pages (pool), tiers, KV objects (kvstore), the memory policy, huge pages
  worker/     the runner (one forward pass a step), paged KV tensor, CUDA graphs, TP ranks
  attention/  page tables and the attention backends (torch, cpu, flashinfer)
  model/      loading, tokenizer, dtype, the Llama module and its projections
  kernels/    predd's own C kernels for the CPU, their build, bindings and probes

May import: torch, numpy, gguf, safetensors, tokenizers, jinja2, msgpack, zmq and the
protocol (symphony_protocol); never liblip, kvfsd or gatewayd (processes talk only
through messages).
"""
