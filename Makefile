# Two commands do everything on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
TP ?= 2
THREADS ?=
QUANT ?=
CKPT ?=
TOKENIZER ?=
MODEL_FILES := $(wildcard *.py)
DEMO_FILES := demo/params.json demo/consolidated.00.pth demo/tokenizer.model
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: install demo-model mar serve stop test bench bench-serving clean check-java

check-java:
	@command -v java >/dev/null || { echo "TorchServe needs Java 17 or newer: sudo apt-get install -y openjdk-17-jre-headless"; exit 1; }

.venv/.runtime: requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

.venv/.test: .venv/.runtime requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

install: check-java .venv/.runtime

# Reproduces demo/ (needs the test packages and Debian's fortunes); the result ships in the repository.
demo-model: .venv/.test
	$(PY) tools/train_demo.py --out demo

build/model-config.yaml: model-config.yaml tools/configure.py .venv/.runtime FORCE
	$(PY) tools/configure.py --out $@.new --tp $(TP) $(if $(THREADS),--threads $(THREADS)) $(if $(QUANT),--quant $(QUANT)) $(if $(CKPT),--checkpoint $(CKPT)) $(if $(TOKENIZER),--tokenizer $(TOKENIZER))
	@cmp -s $@.new $@ && rm $@.new || mv $@.new $@
FORCE:

model_store/llama.mar: build/model-config.yaml $(MODEL_FILES) tools/build_mar.py $(if $(CKPT),,$(DEMO_FILES))
	$(PY) tools/build_mar.py --config build/model-config.yaml --export-path model_store $(if $(CKPT),,--weights demo)

mar: install model_store/llama.mar

serve: mar
	@if curl -s -o /dev/null http://127.0.0.1:8080/ping; then echo "TorchServe is already running here: make stop first"; exit 1; fi
	mkdir -p logs && .venv/bin/torchserve --start --ncs --ts-config config.properties --model-store model_store \
	  --models llama=llama.mar > logs/torchserve.out 2>&1
	@$(PY) tools/wait_ready.py --url http://127.0.0.1:8080 --key-file key_file.json --timeout 600 --examples

stop:
	-.venv/bin/torchserve --stop

test: check-java .venv/.test
	$(PY) -m pytest -q tests

bench: .venv/.test
	$(PY) bench/decode.py

bench-serving: .venv/.test
	$(PY) bench/serving.py --compare

clean:
	rm -rf build model_store logs key_file.json .pytest_cache
