"""kvfsd: the FUSE daemon that exposes KV caches as files."""
