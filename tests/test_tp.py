"""Tensor parallelism on CPU: torchrun starts TP=2 or TP=4 ranks (gloo) running
tests/tp_worker.py, whose logits must equal the in-process TP=1 model's, and, within each
TP run, incremental decoding must give the logits of one full forward pass."""

import pytest
import torch

import llama2
import make_checkpoint
from conftest import CONFIGS, TOKENIZER
from tokenizer import Tokenizer
from torchrun import run
from tp_worker import expected_rows, fixed_tokens, max_diff, run_model

pytestmark = pytest.mark.slow  # torchrun ranks

TOL = 1e-4


def expected_shapes(args: llama2.ModelArgs, world_size: int) -> dict:
    """Shapes of a rank's first-layer shards: its query heads and their KV heads (a KV
    head replicated when there are fewer than ranks), its part of the FFN width, and its
    part of the vocabulary when that divides evenly."""
    hd, dim, hidden = args.head_dim, args.dim, args.ffn_hidden_dim
    q, kv = args.n_heads // world_size, max(args.n_kv_heads // world_size, 1)
    vocab = args.vocab_size // world_size if args.vocab_size % world_size == 0 else args.vocab_size
    return {"wqkv": ((q + 2 * kv) * hd, dim), "wo": (dim, q * hd), "w13": (2 * hidden // world_size, dim),
            "w2": (dim, hidden // world_size), "output": (vocab, dim)}


def check_tp(folder: str, world_size: int, out_dir, ref=None, *worker_args):
    llama = llama2.tp_llama(None, folder, TOKENIZER, 1)
    tokens = fixed_tokens(llama.runner.vocab_size)
    tp1 = run_model(llama.runner, tokens)
    if ref is not None:
        with torch.no_grad():
            assert max_diff(tp1["full"], ref(tokens).logits.float()) <= TOL
    results = run("tp_worker.py", world_size, out_dir, folder, *worker_args)
    assert len(results) == world_size
    for rank, result in enumerate(results):
        assert result["shapes"] == expected_shapes(llama.model.params, world_size), f"rank {rank}"
        for key in ("full", "decode", "rows"):
            diff = max_diff(result[key], tp1[key])
            assert diff <= TOL, f"rank {rank} {key}: max abs diff {diff} from TP=1"
        # within the TP run itself: incremental decoding == one full forward pass
        assert max_diff(result["decode"], result["full"]) <= TOL
        assert max_diff(result["rows"], expected_rows(result["full"], result["rows"])) <= TOL


@pytest.mark.parametrize("config, layout, world_size", [
    ("mha", "meta:2", 4),  # MP=2 files re-sharded to TP=4
    ("gqa", "hf", 4),  # 2 KV heads on 4 ranks: each KV head on two ranks
    ("mha", "meta:1", 2),
])
def test_tp_equals_tp1(checkpoints, tmp_path, config, layout, world_size):
    ref, folders = checkpoints[config]
    check_tp(folders[layout], world_size, tmp_path, ref)


def test_tp_with_compiled_decode_equals_tp1(checkpoints, tmp_path):
    """ModelRunner.compile_decode() at TP=2, as a server compiles it (cpp_wrapper): the
    compiled steps (all-reduces inside the graph) give the eager TP=1 logits."""
    folders = checkpoints["gqa"][1]
    check_tp(folders["hf"], 2, tmp_path, None, "--compile")


@pytest.mark.parametrize("variant", ["tied", "odd_vocab"])
def test_tp_output_projection_variants(tmp_path, variant):
    """tied: each rank's slice of the vocabulary comes from the embedding; odd_vocab: the
    vocabulary does not divide over the ranks, the output projection is replicated."""
    dim, layers, heads, kv_heads = CONFIGS["gqa"]
    n_words = Tokenizer(TOKENIZER).n_words
    vocab = n_words + n_words % 2 if variant == "tied" else n_words | 1
    ref = make_checkpoint.random_hf_model(dim, layers, heads, kv_heads, vocab, tie=variant == "tied", seed=5)
    layout = "hf" if variant == "tied" else "meta:1"  # Meta MP=2 needs an even vocabulary
    folder = make_checkpoint.write_layouts(ref, str(tmp_path / "ckpt"), TOKENIZER, [layout])[layout]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    check_tp(folder, 2, out_dir, ref)
