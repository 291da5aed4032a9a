"""Shared fixtures: small random checkpoints in every layout, written once per test run
by tools/make_checkpoint.py from one transformers LlamaForCausalLM (the reference)."""

import contextlib
import functools
import gc
import json
import os
import re
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
# Inductor takes the CPU's vector instructions from its flags, without building and loading a
# probe of each in a new process, in every process that compiles (2.6 s of CPU each here;
# read when torch._inductor.config is imported, so before torch). The product's own compiles
# (`make serve`) still probe.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# A process of several threads (a TP=1 server on the cores' threads) whose threads wait for
# each other asleep, not spinning on cores the other tests' processes need.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor's kernels built at -O1, the same numbers in less g++ time, and once for sources
# that differ only in local names (tests/g++-O1, tests/compile_kernel.py, run by this Python),
# in every process the tests start; the C++ compiler both inductor and torch's extensions call.
TESTS_CXX = os.path.join(ROOT, "tests", "g++-O1")
os.environ.setdefault("CXX", TESTS_CXX)
os.environ.setdefault("TESTS_PYTHON", sys.executable)


def set_up_test_process():
    """What a process that runs tests needs; pytest-xdist's controller, which only hands them
    out, spent 2 s of the run's start importing torch (and dynamo) before starting its workers."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    import local_server

    # Each pytest-xdist worker (`make test`) starts its servers, and the processes it runs
    # theirs, on a part of local_server.PORTS of its own: two servers starting at once never
    # pick one port.
    if "PYTEST_XDIST_WORKER" in os.environ:
        worker, workers = int(os.environ["PYTEST_XDIST_WORKER"][2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
        part = len(local_server.PORTS) // workers
        local_server.PORTS = local_server.PORTS[worker * part:(worker + 1) * part]
        os.environ["LOCAL_SERVER_PORTS"] = f"{local_server.PORTS[0]}-{local_server.PORTS[-1]}"
    # One inductor cache (FX graphs, compiled kernels) for this process and every rank it
    # starts: cache_dir() puts it (the default, or the one given) in TORCHINDUCTOR_CACHE_DIR,
    # which torchrun's and TorchServe's workers inherit. Without it a TorchServe's workers,
    # whose TMPDIR is the server's own folder, compiled every graph afresh, in every server.
    cache_dir()
    # The tests' models are tiny: their steps take a fraction of a millisecond on one thread,
    # and on two, while anything else runs on the machine (a server's ranks, another process),
    # up to 20 times longer. torchrun's ranks run on one thread too (tests/torchrun.py).
    torch.set_num_threads(1)
    # Python's full collections walk every object, 0.05-0.46 s each once a compiled test has
    # run (600,000 objects, most of them dynamo's and inductor's), and came every 70,000
    # allocations: 3.5 s of CPU in test_attention, test_model and test_engine, 1.8 s with these.
    gc.set_threshold(50_000, 20, 20)


# --- tiers: `make test` runs every test, `make test-quick` those not marked slow -----------
# A test is slow when it starts TorchServe or torchrun ranks, through one of these fixtures
# (marked here) or by itself (marked in its module; a guard fails a quick test that does), or
# compiles (torch.compile: marked in its module).
TORCHSERVE_FIXTURES = {"server", "llama3_server", "own_server", "limited", "configured", "smollm2_server"}


def pytest_configure(config):
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        set_up_test_process()
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: groups in collection order
        config.option.loadscopereorder = False
    config.addinivalue_line("markers", "slow: starts TorchServe or torchrun ranks, compiles, or takes seconds "
                            "(transformers' models, C++ kernels, corpora; make test-quick leaves it out)")
    config.addinivalue_line("markers", "combinations: every QUANT x handler.compile x handler.attention "
                            "(test_combinations.py: make test-combinations; make test leaves it out)")


# The groups that take longest, longest first (a cold suite, AMD EPYC, 2026-12-07: each module's
# tests 200, 71, 63, 58, 39, 36, 30, 28 and 27 s; the shared server's, 150 tests of many modules,
# between the first two): pytest-xdist hands out groups in the order collected (pytest_configure
# turns off its reordering by test count), so that no long group starts late and keeps one worker
# busy while the other has nothing left (the workers' last tests ended 28 s apart before, 1 s after).
LONGEST_FIRST = ["tests/test_attention.py", "server", "tests/test_smollm2.py", "tests/test_reliability.py",
                 "tests/test_startup.py", "tests/test_block_quant.py", "tests/test_structured_clients.py",
                 "tests/test_speculative.py", "tests/test_decode_graphs.py", "tests/test_tp.py"]


# tryfirst: the groups are marked before pytest-xdist's hook reads them into the test ids
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if TORCHSERVE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        # `make test` runs tests on two workers (pytest-xdist, --dist loadgroup), a module's on
        # one, so that its module fixtures are made once, and every test of the run's shared
        # server on one, so that it starts once
        item.group = "server" if "server" in fixtures else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(item.group))
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.group, len(rank)))  # stable: the rest as collected


def pytest_xdist_node_collection_finished(node, ids):
    """Every test id a worker collected carries its group (id@group). With pytest 9.2, whose ids
    no longer come from the attribute pytest-xdist 3.8 sets, every group was lost without a
    word, and a module's fixtures (SmolLM2's reference, its servers) were made on both workers."""
    if node.config.getoption("dist") == "loadgroup" and (ungrouped := [i for i in ids if "@" not in i]):
        raise pytest.UsageError(f"pytest-xdist did not group these tests by their xdist_group: {ungrouped[:2]}")


def pytest_sessionfinish():
    if local_server := sys.modules.get("local_server"):  # (not imported by pytest-xdist's controller)
        local_server.wait_for_stops()  # servers stopped with wait=False, on their threads


@pytest.fixture(autouse=True)
def quick_tests_start_nothing(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return

    import local_server
    import torchrun

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts TorchServe or torchrun ranks: mark it slow")

    for name in ("start", "make_serve"):
        monkeypatch.setattr(local_server.Server, name, refuse)
    monkeypatch.setattr(torchrun, "run_ranks", refuse)


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers' GGUF loader (or gguf's reader) with each file parsed once, from its bytes
    in memory: transformers makes a gguf.GGUFReader for the config, another for the weights and
    one for the tokenizer (4.6 s each for SmolLM2 here), and gguf's tensor-name map again for
    each of the model's tensors (5.5 s in all); and gguf's reader slices its file 150,000 times
    as it parses it, each slice of an np.memmap costing that class's bookkeeping (SmolLM2's
    reference: 2.8 s of CPU against 5.4). The same parse of the same bytes, so the reference
    loads the same model and tokenizer."""
    import gguf
    import gguf.gguf_reader

    saved = gguf.GGUFReader, gguf.get_tensor_name_map, gguf.gguf_reader.np
    gguf.GGUFReader, gguf.get_tensor_name_map = map(functools.cache, saved[:2])
    gguf.gguf_reader.np = NumpyReadingWholeFiles()
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf.gguf_reader.np = saved


class NumpyReadingWholeFiles:
    """numpy, whose memmap(path) reads the file into an array (gguf's reader maps it read-only):
    gguf's own parsing code still reads the file, not ours (gguf_checkpoint.Reader)."""

    def __init__(self):
        import numpy
        self.numpy = numpy

    def __getattr__(self, name: str):
        return getattr(self.numpy, name)

    def memmap(self, path, mode: str = "r"):
        assert mode == "r", mode
        data = self.numpy.fromfile(path, dtype=self.numpy.uint8)
        data.flags.writeable = False
        return data


TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")  # make smollm2

# name: (dim, layers, heads, kv_heads); "gqa" has fewer KV heads than TP=4 ranks
CONFIGS = {"mha": (64, 2, 4, 4), "gqa": (64, 2, 8, 2)}


def build(out_dir, name, layouts=("hf", "meta:1", "meta:2"), **kwargs):
    import make_checkpoint
    from tokenizer import Tokenizer

    dim, layers, heads, kv_heads = CONFIGS[name]
    model = make_checkpoint.random_hf_model(dim, layers, heads, kv_heads, Tokenizer(TOKENIZER).n_words,
                                            seed=len(name), **kwargs)
    folders = make_checkpoint.write_layouts(model, str(out_dir), TOKENIZER, list(layouts))
    return model, folders


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{config name: (hf reference model, {layout: folder})}"""
    return {name: build(tmp_path_factory.mktemp(name), name) for name in CONFIGS}


DEMO = os.environ.get("TEST_WEIGHTS", os.path.join(ROOT, "demo"))  # the checkpoint the server tests serve
SERVER_SLOTS = 4
SERVER_MAX_SEQ_LEN = 512


def parting(ours: list, theirs: list) -> int | None:
    """The first position where two token lists differ, None where one is a prefix of the other."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def start_demo_server(workdir, env: dict | None = None, faults: bool = False, tp: int = 2, weights: str = DEMO,
                      **handler):
    """A TorchServe (TP=2 on CPU, or tp ranks of one thread each) serving DEMO (or weights, a
    checkpoint with DEMO's tokenizer) with the tests' slots and context, its frontend and
    workers with the runtime requirements alone
    (tests/runtime.py); handler: more settings for model-config.yaml's handler section; env:
    more environment variables; faults: the handler is tests/fault_handler.py's, which injects
    tests/injected.py's faults."""
    from local_server import start_server
    from runtime import environment

    tests = os.path.join(ROOT, "tests")
    files = {"handler_file": os.path.join(tests, "fault_handler.py"),
             "modules": (os.path.join(tests, "injected.py"),)} if faults else {}
    return start_server(workdir, weights, tp=tp, env=environment(workdir, env or {}), batch_size=SERVER_SLOTS,
                        threads=1, handler={"max_seq_len": SERVER_MAX_SEQ_LEN} | handler, **files)


def configure_line(folder: str, tmp_path, monkeypatch, capsys, *options: str) -> str:
    """What tools/configure.py, as `make serve` runs it, ends with for folder (and more
    command-line options): the line it exits with ('cannot serve: ...') or what it prints
    when it accepts the checkpoint."""
    import configure

    out = str(tmp_path / "build" / "model-config.yaml")
    monkeypatch.setattr(sys, "argv", ["configure.py", "--out", out, "--checkpoint", folder, "--device", "cpu",
                                      *options])
    try:
        configure.main()
    except SystemExit as e:
        return str(e.code)
    return capsys.readouterr().out


def read_now(inflight, req_id: str, path: str, raw):
    """InFlight.read, again until it is not None: a request's grammars compile on a thread of
    their own, which TorchServe's next iterations would wait for."""
    read = inflight.read(req_id, path, raw)
    while read is None:
        inflight.wait_for_grammars(1.0)
        read = inflight.read(req_id, path, raw)
    return read


def decoded_after_leaving(server, body: dict, read: int) -> tuple[list[str], int]:
    """Stream body, read `read` lines and close, as a client that goes away; then wait for the
    handler's 'done' line of that request. Returns the texts read and the tokens it generated."""
    r = server.post(body | {"stream": True}, stream=True)
    lines = r.iter_lines()
    received = [json.loads(next(lines))["text"] for _ in range(read)]
    r.close()
    request_id = r.headers["x-request-id"]
    deadline = time.time() + 30
    while not (done := re.search(rf"done {request_id} rank=0 .* generated=\[(\d+)\]", server.log())):
        assert time.time() < deadline, "the handler never let the request go"
        # TorchServe sends the worker nothing while no request is in flight: one that is lets
        # the worker learn that the stream is gone and free its blocks
        server.generate({"prompt": "ping", "max_new_tokens": 1})
    return received, int(done.group(1))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One TorchServe for the whole test run; its handler raises where a prompt asks it to
    (tests/injected.py), which test_batching.py uses to show what a bug costs. Its steps overlap
    TorchServe's round trip, one per iteration, as on a GPU (handler.overlap auto, the
    other servers here, runs 4 steps or more in turn on a CPU whose cores all compute)."""
    srv = start_demo_server(tmp_path_factory.mktemp("torchserve"), faults=True, overlap=True,
                            steps_per_iteration=1)
    srv.initial_pids = srv.worker_pids()
    yield srv
    srv.stop(wait=False)


@pytest.fixture(scope="session")
def demo_llama():
    """DEMO in this process (TP=1): the reference for what the server answers."""
    from llama2 import tp_llama

    return tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), 1, max_batch_size=SERVER_SLOTS,
                    max_seq_len=SERVER_MAX_SEQ_LEN)


# --- Llama 3: tiny checkpoints with a byte-level BPE trained here --------------------------

LLAMA3_RANKS = 512  # 256 bytes + 256 merges; with Llama 3's 256 special tokens, 768 ids
# A chat template written for these tests in the style of Llama 3's (bos_token, trimmed
# content, headers, the date from strftime_now, raise_exception, namespace), rendered by
# transformers as the reference.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' + ns.system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}"
    "{{- raise_exception('Only user and assistant roles are supported after the system message') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# name: (dim, layers, heads, kv_heads, tie, rope_theta, rope_scaling, layouts)
LLAMA3_CONFIGS = {
    # scaling from 16 positions on: it changes the logits of a 100-token input everywhere
    "scaled16": (64, 2, 8, 2, False, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 16}, ("hf",)),
    # Meta's constants (what use_scaled_rope means) with 3.2's factor 32; a small theta makes
    # them matter within 100 positions
    "meta_untied": (64, 2, 8, 2, False, 10000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}, ("hf", "meta:2")),
    "meta_tied": (64, 2, 8, 2, True, 10000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}, ("hf", "meta:2")),
}


def llama3_training_text() -> str:
    """Stable English (the standard library's docstrings) and some other scripts."""
    import argparse
    import json
    import re
    import string
    import textwrap

    return "".join(m.__doc__ for m in (re, json, argparse, string, textwrap)) + \
        "Größe, naïve café, 日本語のテキスト, Ελληνικά, emoji 😀🦙 and tabs\tand   spaces.\n" * 3


@pytest.fixture(scope="session")
def llama3(tmp_path_factory):
    """{name: (transformers reference model, {layout: folder})} for LLAMA3_CONFIGS, with
    Llama 3 tokenizers: Meta's tokenizer.model in Meta folders, tokenizer.json (+ the chat
    template) in Hugging Face folders."""
    import make_checkpoint

    ranks = make_checkpoint.train_llama3_ranks(llama3_training_text(), LLAMA3_RANKS)
    ids = make_checkpoint.llama3_ids(LLAMA3_RANKS)
    out = {}
    for name, (dim, layers, heads, kv, tie, theta, scaling, layouts) in LLAMA3_CONFIGS.items():
        model = make_checkpoint.random_hf_model(
            dim, layers, heads, kv, LLAMA3_RANKS + 256, tie=tie, rope_theta=theta, rope_scaling=scaling,
            seed=len(name), max_positions=512, bos_id=ids["<|begin_of_text|>"],
            eos_id=[ids[t] for t in make_checkpoint.LLAMA3_STOPS])
        folders = make_checkpoint.write_llama3(model, ranks, str(tmp_path_factory.mktemp(name)), list(layouts),
                                               LLAMA3_TEMPLATE)
        out[name] = (model, folders)
    return out
