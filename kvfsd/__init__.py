"""kvfsd: the FUSE daemon that exposes KV caches as files — names and inodes (namespace),
FUSE calls mapped onto them (fs), the caches behind the names with their recovery,
memory policy, expiry and migration between replicas, and kvfsd's link to predd.

May import: pyfuse3, trio, the protocol (symphony_protocol) and liblip's client (kvfsd
is a client of predd like any program); never predd or gatewayd internals.
"""
