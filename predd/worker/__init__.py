"""The runner: the model, the paged KV tensor and the attention backend, one forward pass
a step over the engine's chunks; CUDA graphs of decode steps; tensor-parallel ranks.

May import: torch, numpy; predd.engine.chunk (the step record it computes),
predd.kernels, predd.model, predd.attention, predd.memory; for tensor-parallel ranks,
predd.server.launch.
"""
