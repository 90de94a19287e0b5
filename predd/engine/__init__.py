"""The step loop: requests become calls, the scheduler plans each step, the runner computes it, outputs become replies; sampling, return times, held changes and metrics.

May import: the protocol records (liblip.protocol); predd.memory.policy, predd.worker, predd.model.llama, predd.kernels.
"""
