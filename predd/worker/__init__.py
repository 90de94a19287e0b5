"""The runner: the model, the paged KV tensor and the attention backend, one forward pass a step; CUDA graphs of decode steps; tensor-parallel ranks.

May import: torch, numpy; predd.kernels, predd.model, predd.attention, predd.memory; for
tensor-parallel ranks, predd.server.launch.
"""
