# Two entry points for a fresh machine: `make test` and `make demo`.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU build from local disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU_PIN ?= torch==2.13.0

.PHONY: test test-gpu demo serve bench-fragmentation clean

# `make serve`: a real small instruct model (SmolLM2-135M-Instruct, from the package index) on CPU, local Ray.
SERVE_HOST ?= 127.0.0.1
SERVE_PORT ?= 8000
SERVE_ARGS ?= --device cpu --kv-memory 512MiB --max-model-len 4096 --served-model-name smollm2

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q $(TORCH_CPU_PIN); fi
	$(PY) -m pip install -q -e '.[test]'
	# Debian's prometheus (with promtool) scrapes the server and checks the alert rules, its headless chromium loads
	# /dashboard, and redis-server holds the GCS's tables in the fault-tolerance test (tests/server and tests/deploy;
	# they skip, saying so, without them).
	for pkg in prometheus chromium redis-server; do command -v $$pkg >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q $$pkg >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $$pkg >/dev/null; }; }; } || \
		echo "$$pkg could not be installed: its tests will skip"; done
	# checkov scans the rendered Helm chart (tests/deploy); its own venv: its pins are not the project's.
	python3 -m venv $(VENV)/checkov && $(VENV)/checkov/bin/pip install -q 'checkov>=3.2.0'
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

serve: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[starter]'
	$(PY) -m server.cli serve --model "$$($(PY) -m server.starter_model)" --host $(SERVE_HOST) --port $(SERVE_PORT) $(SERVE_ARGS)

demo: $(VENV)/.installed
	$(PY) -m kvmem.demo

bench-fragmentation: $(VENV)/.installed
	$(PY) bench/fragmentation.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
