# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-llama-cpp setup clean

# torch is pinned to the CPU build on machines without CUDA; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q 'torch>=2.4,<3'; else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[test]'
	# Debian's chromium renders verify's HTML report in the browser test.
	command -v chromium >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }
	# Debian's prometheus gives promtool (rules tests) and the real Prometheus the canary gate tests query.
	# Where systemd runs, the package starts a service on :9090: stop and disable it (tests start their own).
	command -v promtool >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus >/dev/null; $$SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; }
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/quantship demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# llama.cpp (through llama-cpp-python, compiled from source: ~30 min on 2 cores the first time, then
# pip's wheel cache) loading our GGUF files; `make test` skips those tests when it is not installed.
LLAMA_CPP_STAMP := $(VENV)/.llama-cpp-installed
$(LLAMA_CPP_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
		-DLLAMA_BUILD_SERVER=OFF" $(BIN)/pip install -q -e '.[llama-cpp]'
	touch $(LLAMA_CPP_STAMP)

test-llama-cpp: $(LLAMA_CPP_STAMP)
	$(BIN)/python -m pytest -q tests/test_gguf_llama_cpp.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
