"""predd's own CPU kernels (C in csrc/, built for this machine on first use) and their Python side: the build, the ctypes bindings, the ops, the probes, and the layer loop that runs a step's layers in one C call.

May import: torch, numpy; predd.model, and for the layer loop (which drives a whole step)
predd.attention and predd.worker.
"""
