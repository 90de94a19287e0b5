"""predd's own CPU kernels (C in csrc/, built for this machine on first use) and their
Python side: the build (build.py), the ctypes bindings checked against the C header
(bindings.py), the typed calls (library.py), loading with the probes and the ops a layer
uses (cpu_kernels.py, probes.py), and the layer loop that runs a step's layers in one C
call (layer_loop.py).

May import: torch, numpy; predd.model, and for the layer loop (which drives a whole step)
predd.attention and predd.worker.
"""
