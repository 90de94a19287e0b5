"""predd as a daemon: the ZeroMQ loop, sessions and who they are (kernel credentials,
tokens), capabilities, quotas and request limits, the request handlers, the logits
buffer shared with a client, and launching predd from another process.

May import: zmq, the protocol records (symphony_protocol); predd.engine and below.
"""
