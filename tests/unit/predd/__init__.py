"""Unit tests of predd: the kernels, the model, attention, the runner, memory, the engine and the server, part by part."""
