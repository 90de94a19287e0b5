"""The step loop: requests become calls, the scheduler plans each step, the runner computes it, outputs become replies; sampling, return times, held changes and metrics.

May import: the protocol records (symphony_protocol); predd.memory, predd.worker, predd.model,
predd.kernels; and, as the engine dispatches each request, predd.server's sessions,
capabilities, identity, quotas, limits and handlers.
"""
