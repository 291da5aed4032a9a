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
