"""Unit tests of the benchmark and simulation scripts' own logic."""
