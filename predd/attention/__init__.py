"""Attention over the paged KV pool: the page tables every backend reads, the step's K/V
writes into their slots, and the backends (torch, predd's CPU kernels, FlashInfer) with
the start-up choice among them.

May import: torch, numpy; predd.kernels; predd.worker's paged KV tensor.
"""
