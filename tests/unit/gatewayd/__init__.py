"""Unit tests of gatewayd: the gateway's parts, placement and replica metrics."""
