"""The model, the checkpoint readers and tp_llama at TP=1, in-process: logits against
transformers' LlamaForCausalLM on the same random weights, incremental decoding against one
full forward pass, model_args handling, and the errors that bad checkpoints raise."""

import glob
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
import llama2
import make_checkpoint
import tp
from conftest import CONFIGS, TOKENIZER
from runner import ModelRunner
from tokenizer import Tokenizer
from tp_worker import expected_rows, fixed_tokens, max_diff, run_decode, run_model, run_rows

TOL = 1e-4
LAYOUTS = ["hf", "meta:1", "meta:2"]


def load(folder, model_args=None) -> ModelRunner:
    return llama2.tp_llama(model_args, folder, TOKENIZER, 1).runner


def random_tokens(vocab_size: int, seqlen: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def reference_logits(ref, tokens: torch.Tensor) -> torch.Tensor:
    return ref(tokens).logits.float()


def assert_matches_reference(runner, ref, seqlen: int = 12):
    tokens = random_tokens(ref.config.vocab_size, seqlen)
    diff = max_diff(runner(tokens, 0), reference_logits(ref, tokens))
    assert diff <= TOL, f"max abs diff {diff} from transformers' LlamaForCausalLM"


def copy_folder(checkpoints, tmp_path, config: str, layout: str) -> str:
    dst = str(tmp_path / layout.replace(":", "_mp"))
    shutil.copytree(checkpoints[config][1][layout], dst)
    return dst


def checkpoint_model_args(folder: str, **overrides) -> llama2.ModelArgs:
    """ModelArgs that agree with the checkpoint in folder."""
    return llama2.ModelArgs(**{**checkpoint.open_checkpoint(folder).model_args, **overrides})


# --- logits ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_logits_match_transformers(checkpoints, config, layout):
    ref, folders = checkpoints[config]
    runner = load(folders[layout])
    assert (runner.model.params.n_heads, runner.model.params.n_kv_heads) == CONFIGS[config][2:]
    assert_matches_reference(runner, ref)


def test_reference_comparison_can_fail(checkpoints, monkeypatch):
    """The logits are far from tiny, and loading Hugging Face's q/k rows without undoing
    their rotary permutation moves them by far more than the tolerance."""
    ref, folders = checkpoints["gqa"]
    tokens = random_tokens(ref.config.vocab_size)
    expected = reference_logits(ref, tokens)
    assert expected.std() > 1000 * TOL
    monkeypatch.setattr(checkpoint, "unpermute_rotary", lambda w, head_dim: w)
    broken = load(folders["hf"])(tokens, 0)
    assert max_diff(broken, expected) > 100 * TOL


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prefill_then_single_token_steps_equal_full_forward(checkpoints, config):
    model = load(checkpoints[config][1]["meta:2"])
    tokens = fixed_tokens(model.vocab_size)
    full = model(tokens, 0)
    assert max_diff(run_decode(model, tokens), full) <= TOL


@pytest.mark.parametrize("config", list(CONFIGS))
def test_per_row_positions_and_slots_equal_full_forward(checkpoints, config):
    model = load(checkpoints[config][1]["hf"])
    tokens = fixed_tokens(model.vocab_size)
    full = model(tokens, 0)
    rows = run_rows(model, tokens)
    assert rows[~rows.isnan()].numel() > 0
    assert max_diff(rows, expected_rows(full, rows)) <= TOL


@pytest.mark.slow
def test_compiled_decode_equals_eager_and_never_recompiles(checkpoints):
    """compile_decode() (torch.compile of the one-token steps) changes no logits, and the
    two graphs it compiles up front, one row and several (block tables of one block are
    padded to two), serve every batch size and position: a recompile here would be one per
    position in a server (and eager again after 8). With sdpa: these contexts never reach
    auto's flex, whose compiled steps test_attention.py checks."""
    model = llama2.tp_llama(None, checkpoints["gqa"][1]["hf"], TOKENIZER, 1, max_batch_size=8,
                            attention="sdpa").runner
    tokens = fixed_tokens(model.vocab_size)
    eager = run_model(model, tokens)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.compile_decode()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run_model(model, tokens)
        model(tokens[:1, :1], 0)  # a one-token prompt's prefill
        for rows in (1, 3, 8):
            step = torch.zeros(rows, 1, dtype=torch.long)
            for pos in range(4, 40, 7):
                model(step, pos)
                model(step, [max(pos - i, 0) for i in range(rows)])
    for key in ("decode", "rows"):
        assert max_diff(compiled[key], eager[key]) <= 1e-5, key


def test_meta_shards_are_split_as_fairscale_splits_them(checkpoints):
    """make_checkpoint writes the Meta layout with checkpoint.MP_SPLIT_DIM, so the logits
    tests cannot see a wrong split there; this checks it against Meta's model code
    (ParallelEmbedding splits the embedding width, ColumnParallelLinear the output rows,
    RowParallelLinear the input columns)."""
    column_parallel = {"output", "wq", "wk", "wv", "w1", "w3"}  # split along dim 0
    row_parallel = {"tok_embeddings", "wo", "w2"}  # split along dim 1
    folder = checkpoints["gqa"][1]["meta:2"]
    shards = [torch.load(os.path.join(folder, f"consolidated.0{i}.pth"), weights_only=True) for i in range(2)]
    full = make_checkpoint.meta_state_dict(checkpoints["gqa"][0])
    for name, t in full.items():
        kind = name.split(".")[-2]
        split = 0 if kind in column_parallel else 1 if kind in row_parallel else None
        for i, shard in enumerate(shards):
            expected = t if split is None else t.chunk(2, dim=split)[i]
            assert torch.equal(shard[name], expected), name


# --- Hugging Face variants -------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
    """(reference, folder) of the gqa config saved as several safetensors files + index."""
    dim, layers, heads, kv_heads = CONFIGS["gqa"]
    ref = make_checkpoint.random_hf_model(dim, layers, heads, kv_heads, Tokenizer(TOKENIZER).n_words, seed=7)
    folders = make_checkpoint.write_layouts(ref, str(tmp_path_factory.mktemp("sharded")), TOKENIZER, ["hf"], "200KB")
    return ref, folders["hf"]


def test_sharded_safetensors_with_index(sharded_hf):
    ref, folder = sharded_hf
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1
    assert_matches_reference(load(folder), ref)


@pytest.mark.parametrize("layout", ["hf", "meta:2"])
def test_tied_word_embeddings(tmp_path, layout):
    dim, layers, heads, kv_heads = CONFIGS["mha"]
    ref = make_checkpoint.random_hf_model(dim, layers, heads, kv_heads, Tokenizer(TOKENIZER).n_words,
                                          tie=True, seed=3)
    folder = make_checkpoint.write_layouts(ref, str(tmp_path), TOKENIZER, [layout])[layout]
    runner = load(folder)
    if layout == "hf":
        names = set(load_file(os.path.join(folder, "model.safetensors")))
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        assert runner.model.output.weight is runner.model.tok_embeddings.weight
    assert_matches_reference(runner, ref)


# --- model_args ------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("dim", 128), ("n_layers", 3), ("n_heads", 8), ("n_kv_heads", 2),
                                          ("vocab_size", 4099), ("intermediate_size", 256),
                                          ("norm_eps", 1e-6), ("rope_theta", 5e5)])
@pytest.mark.parametrize("layout", ["hf", "meta:1"])
def test_model_args_that_disagree_with_the_checkpoint_raise(checkpoints, layout, field, value):
    folder = checkpoints["mha"][1][layout]
    load(folder, checkpoint_model_args(folder))  # agreeing ones load
    args = checkpoint_model_args(folder, **{field: value})
    name = "ffn_hidden_dim" if field == "intermediate_size" else field
    with pytest.raises(ValueError, match=rf"\b{name}: given {re.escape(str(value))},"):
        load(folder, args)


def test_vocab_size_minus_one_is_taken_from_tokenizer_or_checkpoint(checkpoints, tmp_path):
    ref, _ = checkpoints["mha"]
    folder = copy_folder(checkpoints, tmp_path, "mha", "meta:1")
    params_path = os.path.join(folder, "params.json")
    with open(params_path) as f:
        params = json.load(f)
    params["vocab_size"] = -1  # as in Meta's own Llama 2 params.json
    with open(params_path, "w") as f:
        json.dump(params, f)
    model = load(folder)
    assert model.vocab_size == Tokenizer(TOKENIZER).n_words
    assert_matches_reference(model, ref)

    hf = checkpoints["mha"][1]["hf"]  # model_args with vocab_size -1: the checkpoint's
    model = load(hf, checkpoint_model_args(hf, vocab_size=-1))
    assert model.vocab_size == ref.config.vocab_size


def test_model_args_size_the_kv_cache(checkpoints):
    ref, folders = checkpoints["gqa"]
    folder = folders["hf"]
    runner = load(folder, checkpoint_model_args(folder, max_batch_size=3, max_seq_len=24))
    p = runner.model.params
    assert (runner.max_batch_size, runner.max_seq_len) == (3, 24)
    blocks = 3 * 2  # rows of 24 tokens in blocks of 16
    for layer in runner.model.layers:
        assert layer.attention.cache_k.shape == (p.n_kv_heads, blocks, 16, p.head_dim)
        assert layer.attention.cache_v.shape == layer.attention.cache_k.shape
    assert_matches_reference(runner, ref, seqlen=24)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        runner(random_tokens(p.vocab_size, 25), 0)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        runner(random_tokens(p.vocab_size, 4), 0, slot=2)

    default = load(folder)  # without model_args: ModelArgs' defaults
    rows, length = llama2.ModelArgs.max_batch_size, llama2.ModelArgs.max_seq_len
    assert default.model.layers[0].attention.cache_k.shape[1:3] == (rows * length // 16, 16)


# --- bad checkpoints -------------------------------------------------------------------

@pytest.mark.parametrize("shard", [0, 1])
def test_missing_meta_shard(checkpoints, tmp_path, shard):
    folder = copy_folder(checkpoints, tmp_path, "mha", "meta:2")
    os.remove(os.path.join(folder, f"consolidated.{shard:02d}.pth"))
    with pytest.raises(checkpoint.CheckpointError, match=rf"missing.*consolidated\.{shard:02d}\.pth"):
        load(folder)


def test_missing_safetensors_shard(sharded_hf, tmp_path):
    _, src = sharded_hf
    folder = str(tmp_path / "hf")
    shutil.copytree(src, folder)
    shards = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    assert len(shards) > 1
    os.remove(shards[1])
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"missing shard .*{os.path.basename(shards[1])}.*model\.safetensors\.index\.json"):
        load(folder)


@pytest.mark.parametrize("layout", ["hf", "meta:1", "meta:2"])
def test_tensor_with_wrong_shape(checkpoints, tmp_path, layout):
    folder = copy_folder(checkpoints, tmp_path, "gqa", layout)
    if layout == "hf":
        path = os.path.join(folder, "model.safetensors")
        name = "model.layers.1.self_attn.k_proj.weight"
        tensors = load_file(path)
        tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    else:
        path = os.path.join(folder, "consolidated.00.pth")
        name = "layers.1.attention.wk.weight"
        tensors = torch.load(path, weights_only=True)
        tensors[name] = tensors[name][:, :-1].clone()
        torch.save(tensors, path)
    with pytest.raises(checkpoint.CheckpointError) as e:
        load(folder)
    message = str(e.value)
    assert name in message and path in message and "shape" in message


class RunsCode:
    """Unpickling this runs `touch path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_pickled_code_is_refused(checkpoints, tmp_path):
    folder = copy_folder(checkpoints, tmp_path, "mha", "meta:2")
    path = os.path.join(folder, "consolidated.01.pth")
    shard = torch.load(path, weights_only=True)
    sentinel = tmp_path / "sentinel"
    shard["layers.0.attention.wq.weight"] = RunsCode(sentinel)
    torch.save(shard, path)
    with pytest.raises(checkpoint.CheckpointError, match=rf"cannot load {path} as plain tensors"):
        load(folder)
    assert not sentinel.exists()

    # the payload is live: a plain unpickler does run it
    torch.load(path, weights_only=False)
    assert sentinel.exists()


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"head_dim": 32}, "head_dim 32"),
])
def test_unsupported_hf_config_is_refused(checkpoints, tmp_path, change, message):
    folder = copy_folder(checkpoints, tmp_path, "mha", "hf")
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(change)
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{config_path}: {message}.* not implemented"):
        load(folder)


def test_unsupported_meta_params_are_refused(checkpoints, tmp_path):
    folder = copy_folder(checkpoints, tmp_path, "mha", "meta:1")
    params_path = os.path.join(folder, "params.json")
    with open(params_path) as f:
        params = json.load(f)
    with open(params_path, "w") as f:
        json.dump({**params, "vision_chunk_size": 560}, f)  # Llama 3.2 Vision
    with pytest.raises(checkpoint.CheckpointError, match=rf"{params_path}: unsupported parameters \['vision_chunk_size'\]"):
        load(folder)


# --- head split ------------------------------------------------------------------------

@pytest.mark.parametrize("n_heads, n_kv_heads, world_size, message", [
    (4, 4, 3, "n_heads 4 cannot be split over 3 ranks"),
    (12, 6, 4, "n_kv_heads 6 cannot be split over 4 ranks"),
    (12, 3, 4, "4 ranks cannot share 3 KV heads evenly"),
])
def test_heads_that_do_not_divide_over_ranks_raise(n_heads, n_kv_heads, world_size, message):
    args = llama2.ModelArgs(dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=32)
    with pytest.raises(ValueError, match=message):
        tp.head_ranges(args, 0, world_size)


@pytest.mark.parametrize("n_heads, n_kv_heads, world_size", [
    (4, 4, 1), (4, 4, 2), (4, 4, 4), (8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 1, 4), (32, 8, 8), (64, 8, 16)])
def test_head_ranges_give_each_rank_the_kv_heads_of_its_query_heads(n_heads, n_kv_heads, world_size):
    args = llama2.ModelArgs(dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=32)
    group = n_heads // n_kv_heads  # query head h uses KV head h // group
    seen = []
    for rank in range(world_size):
        q, kv = tp.head_ranges(args, rank, world_size)
        seen += list(q)
        assert len(q) == n_heads // world_size and len(kv) == max(n_kv_heads // world_size, 1)
        assert sorted({h // group for h in q}) == list(kv)
    assert seen == list(range(n_heads))


def test_apply_rotary_emb_rotates_each_pair_by_its_angle():
    """Meta's interleaved rotary, written out in real numbers: pair (x0, x1) of position t and
    frequency f becomes (x0 cos a - x1 sin a, x0 sin a + x1 cos a) with a = t * f."""
    seq, heads, head_dim, theta = 5, 3, 8, 10000.0
    xq, xk = torch.randn(2, seq, heads, head_dim), torch.randn(2, seq, 1, head_dim)
    angles = torch.arange(seq)[:, None] * theta ** (-torch.arange(0, head_dim, 2) / head_dim)
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]

    def by_hand(x):
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)

    q, k = llama2.apply_rotary_emb(xq, xk, llama2.precompute_freqs_cis(head_dim, seq, theta))
    assert max_diff(q, by_hand(xq)) < 1e-5 and max_diff(k, by_hand(xk)) < 1e-5
