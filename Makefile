# make setup | test | test-fast | unit | demo | lib | bench | bench-setup | clean | distclean
# Every target that runs code first runs scripts/setup.sh, which installs only what
# is missing and returns in about a second when nothing is.

VENV ?= .venv
PY = $(VENV)/bin/python
PYTEST_ARGS ?=
export VENV

.PHONY: all setup test test-fast unit demo lib bench bench-setup clean distclean

all: test

setup:
	bash scripts/setup.sh

# pytest's exit status is make's: a failing or empty run fails the target.
test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# The suite without the tests marked slow (examples, restarts, whole servers, scale,
# the transformers references): unit and the quick integration tests.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

unit: setup
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/unit

demo: setup
	bash scripts/demo.sh

# liblip for C (liblip/c/liblip.h) and its example, into $(BUILD); needs libzmq3-dev and
# libmsgpack-dev, which `make setup` installs.
BUILD ?= build
LIP_C = liblip/c
lib: $(BUILD)/liblip.so $(BUILD)/lip-greedy

$(BUILD)/liblip.so: $(LIP_C)/liblip.c $(LIP_C)/liblip.h
	mkdir -p $(BUILD)
	$(CC) -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $(LIP_C)/liblip.c \
		$$(pkg-config --cflags --libs libzmq msgpack)

$(BUILD)/lip-greedy: $(LIP_C)/examples/greedy.c $(BUILD)/liblip.so
	$(CC) -O2 -Wall -Wextra -Werror -I$(LIP_C) -o $@ $< -L$(BUILD) -llip \
		-Wl,-rpath,'$$ORIGIN'

# The baselines (vLLM's CPU build in its own venv, the model as a Hugging Face directory)
# go to BENCH_DIR (default ~/.cache/symphony-bench), never into $(VENV). `make bench`
# runs without them and says so.
bench-setup: setup
	bash scripts/bench_setup.sh

# B2 (RAG) runs as its --quick smoke: its full run (`$(PY) scripts/bench_rag.py`) takes
# well over 15 minutes on a 2-core CPU. B3 (fork) runs in full.
bench: setup
	$(PY) scripts/bench_completion.py
	$(PY) scripts/bench_fairness.py
	$(PY) scripts/bench_rag.py --quick
	$(PY) scripts/bench_fork.py
	$(PY) scripts/bench_overhead.py
	$(PY) scripts/bench_agent.py
	$(PY) scripts/bench_got.py
	$(PY) scripts/bench_swarm.py
	$(PY) scripts/bench_loop.py
	$(PY) scripts/bench_http.py

# Caches and build output only; run/ is skipped since it may hold a live mount.
clean:
	find . \( -path ./.git -o -path ./$(VENV) -o -path ./run \) -prune -o \
		\( -name __pycache__ -o -name .pytest_cache -o -name '*.egg-info' \) \
		-prune -exec rm -rf {} +
	rm -rf build dist

distclean: clean
	rm -rf $(VENV)
