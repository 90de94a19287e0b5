"""Unit tests of liblip: the client library, the `lip` command and the sandbox."""
