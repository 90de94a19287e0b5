"""KV memory: pages and their refcounts (pool), the tiers that hold their data (device, host, disk), KV objects on top (fork, extract, merge), the policy that moves them between tiers, and huge pages.

May import: torch, numpy; predd.worker (the device tier is the runner's cache).
"""
