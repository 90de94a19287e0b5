"""The step loop: requests come in (intake), become calls, the scheduler plans each step
and admits calls (admission), the runner computes its chunks, outputs become replies;
cancellation, speculative continuation, sampling, return times, held changes, the
engine's configuration and metrics.

May import: the protocol records (symphony_protocol); predd.memory, predd.worker (the
runner), predd.model's tokenizer, predd.kernels (greedy picks); and predd.server's
sessions, capabilities, identity, quotas, request limits and logits buffer (the checks
at the door and the state they keep). Never predd.server's loop or handlers: the server
gives the engine its handlers.
"""
