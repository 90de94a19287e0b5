"""KV memory: pages and their refcounts (pool), the tiers that hold their data (device,
host, disk), KV objects on top (fork, extract, merge), the policy that moves them between
tiers, and huge pages.

May import: torch, numpy, the protocol records (symphony_protocol); the largest position
of predd.server.request_limits.
"""
