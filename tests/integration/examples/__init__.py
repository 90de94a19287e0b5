"""Integration tests of the example programs of mount_examples/, run as LIPs."""
