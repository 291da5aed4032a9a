"""Shared fixtures: small random checkpoints in every layout, written once per test run
by tools/make_checkpoint.py from one transformers LlamaForCausalLM (the reference)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import make_checkpoint  # noqa: E402

TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")

# name: (dim, layers, heads, kv_heads); "gqa" has fewer KV heads than TP=4 ranks
CONFIGS = {"mha": (64, 2, 4, 4), "gqa": (64, 2, 8, 2)}


def build(out_dir, name, layouts=("hf", "meta:1", "meta:2"), **kwargs):
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


def start_demo_server(workdir, env: dict | None = None, **handler):
    """A TorchServe (TP=2 on CPU) serving DEMO with the tests' slots and context; handler:
    more settings for model-config.yaml's handler section; env: more environment variables."""
    from local_server import start_server

    return start_server(workdir, DEMO, tp=2, env=env, batch_size=SERVER_SLOTS,
                        handler={"max_seq_len": SERVER_MAX_SEQ_LEN} | handler)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One TorchServe for the whole test run; its handler raises where a prompt asks it to
    (handler.FAULT), which test_batching.py uses to show what a bug costs."""
    srv = start_demo_server(tmp_path_factory.mktemp("torchserve"), env={"LLAMA_TEST_FAULTS": "1"})
    srv.initial_pids = srv.worker_pids()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def demo_llama():
    """DEMO in this process (TP=1): the reference for what the server answers."""
    from llama2 import tp_llama

    return tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), 1, max_batch_size=SERVER_SLOTS,
                    max_seq_len=SERVER_MAX_SEQ_LEN)
