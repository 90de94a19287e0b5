"""Unit tests of symphony_protocol: requests, replies and their validation; the packages' layering."""
