"""Integration tests of kvfsd: the namespace, its state, handlers, expiry and replicas."""
