"""GGUF files served directly (gguf_checkpoint.py): a Llama's architecture from the file's
metadata, its weights dequantized as each rank loads its shard. The files are written here
with gguf.GGUFWriter as llama.cpp's converter writes them (tools/make_checkpoint.py), from the
random weights the other tests use, and load with the logits of the same weights from
safetensors, at TP 1 and 2 (SmolLM2's real file: test_smollm2.py). What the model does not implement is refused by
name, by `make serve`'s check (tools/configure.py, one line) and by the loader."""

import os
import shutil
import time

import numpy as np
import pytest
import torch
import yaml
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

import checkpoint
import llama2
import make_checkpoint
from conftest import ROOT, TOKENIZER, configure_line
from gguf_checkpoint import GGUFCheckpoint
from local_server import Server
from logits_worker import SEQLEN, long_tokens
from test_startup import no_torchserve_left
from tokenizer import Tokenizer
from torchrun import run

TOL = 1e-4
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
# Meta's Llama 3 constants with Llama 3.2's factor; theta 10000 makes them matter within 100 positions
LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
# A tensor of each type the reader dequantizes. The K-quants sit on row-parallel wo and w2 too,
# whose halves at TP=2 (128 of 256 columns, 384 of 768) are not aligned to their 256-wide blocks.
TYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K, "blk.0.attn_norm.weight": Q.F16,
         "blk.0.ffn_norm.weight": Q.BF16, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1,
         "blk.0.attn_v.weight": Q.Q8_0, "blk.0.attn_output.weight": Q.Q4_K, "blk.0.ffn_gate.weight": Q.Q5_K,
         "blk.0.ffn_up.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q5_K, "blk.1.attn_q.weight": Q.F16,
         "blk.1.attn_k.weight": Q.BF16, "blk.1.attn_output.weight": Q.Q4_1, "blk.1.ffn_gate.weight": Q.Q4_K,
         "blk.1.ffn_down.weight": Q.Q6_K}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def every_projection(qtype: Q, **others: Q) -> dict:
    return {f"blk.{i}.{p}.weight": qtype for i in range(2) for p in PROJECTIONS} | others


# What QUANT keeps as the file has it: Q4_0/Q4_1 for int4 (a tied output from token_embd's Q8_0)
Q4_FILE = every_projection(Q.Q4_1, **{"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0,
                                      "blk.1.ffn_down.weight": Q.Q4_0})
Q8_FILE = every_projection(Q.Q8_0, **{"output.weight": Q.Q8_0})
# name: (dim, layers, heads, KV heads, tied, rope scaling, types (None: all F32))
MODELS = {"llama2": (64, 2, 4, 4, False, None, None),
          "llama3": (64, 2, 8, 2, True, LLAMA3_SCALING, None),
          "typed": (256, 2, 8, 2, False, None, TYPES),
          "q4": (64, 2, 4, 2, True, None, Q4_FILE),
          "q8": (64, 2, 4, 2, False, None, Q8_FILE)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """{name: (transformers model, safetensors folder, GGUF file)} for MODELS, with the demo
    tokenizer's vocabulary; the Llama 2-style file without llama.vocab_size (as older
    converters wrote them: its token list gives the size). A typed model holds its blocks
    dequantized, the weights the safetensors folder has."""
    vocab = Tokenizer(TOKENIZER).n_words
    out = tmp_path_factory.mktemp("gguf")
    result = {}
    for seed, (name, (dim, layers, heads, kv_heads, tie, scaling, types)) in enumerate(MODELS.items()):
        model = make_checkpoint.random_hf_model(dim, layers, heads, kv_heads, vocab, multiple_of=dim, tie=tie,
                                                rope_scaling=scaling, seed=seed, max_positions=512)
        blocks = make_checkpoint.quantize_weights(model, types) if types else None
        folder = make_checkpoint.write_layouts(model, str(out / name), TOKENIZER, ["hf"])["hf"]
        path = str(out / f"{name}.gguf")
        make_checkpoint.save_gguf(model, path, TOKENIZER, blocks, vocab_size=name != "llama2")
        result[name] = (model, folder, path)
    return result


def load(path: str):
    return llama2.tp_llama(None, path, TOKENIZER, 1, max_batch_size=1, max_seq_len=SEQLEN).runner


@torch.no_grad()
def reference(model) -> torch.Tensor:
    return model(long_tokens(model.config.vocab_size)).logits


# --- the logits ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_safetensors(files, name):
    """Same architecture read from the metadata (the Llama 3 scaling from rope_freqs.weight, the
    tied output, the vocabulary from the token list), same logits to the bit."""
    model, folder, path = files[name]
    gguf, safetensors = load(path), load(folder)
    assert gguf.model.params == safetensors.model.params
    assert gguf.model.params.rope_scaling == MODELS[name][5]
    tokens = long_tokens(gguf.vocab_size)
    ours, theirs = gguf(tokens, 0), safetensors(tokens, 0)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max().item()
    assert (ours - reference(model)).abs().max().item() <= TOL


def test_q_and_k_rows_are_read_as_they_are(files, monkeypatch):
    """llama.cpp's converter permutes Hugging Face's q and k rows back into Meta's interleaved
    layout, the model's: read with Hugging Face's un-permutation (what the safetensors reader
    applies), the logits are far off."""
    model, _, path = files["llama3"]
    read_into = GGUFCheckpoint.read_into

    def as_hugging_face(self, piece, out):
        read = read_into(self, piece, out)
        if piece.name.endswith(("wq.weight", "wk.weight")):
            out.copy_(checkpoint.unpermute_rotary(out.clone(), self.model_args["dim"] // self.model_args["n_heads"]))
        return read

    monkeypatch.setattr(GGUFCheckpoint, "read_into", as_hugging_face)
    runner = load(path)
    assert (runner(long_tokens(runner.vocab_size), 0) - reference(model)).abs().max().item() > 100 * TOL


def test_rope_scaling_matters_at_these_positions(files):
    """Without the scaling that rope_freqs.weight gives, the Llama 3-style file's logits are off."""
    model, _, path = files["llama3"]
    runner = load(path)
    p = runner.model.params
    runner.model.freqs_cis = llama2.precompute_freqs_cis(p.head_dim, SEQLEN, p.rope_theta)
    assert (runner(long_tokens(runner.vocab_size), 0) - reference(model)).abs().max().item() > 100 * TOL


@pytest.mark.slow
def test_logits_equal_safetensors_tp2(files, tmp_path):
    """Each rank reads its rows, or the blocks that cover its columns, of every tensor."""
    paths = [p for _, folder, gguf in files.values() for p in (gguf, folder)]
    for rank, result in enumerate(run("logits_worker.py", 2, tmp_path, "--tokenizer", TOKENIZER, *paths)):
        for name, (model, folder, path) in files.items():
            assert torch.equal(result[path], result[folder]), (rank, name)
            assert (result[path] - reference(model)).abs().max().item() <= TOL, (rank, name)


@pytest.mark.parametrize("name, quantization", [("q4", "int4"), ("q8", "int8")])
def test_quantization_keeps_the_files_blocks(files, name, quantization, monkeypatch):
    """QUANT=int4 on Q4_0/Q4_1 tensors and int8 on Q8_0 ones computes the file's own weights:
    each projection's layer holds exactly the weights the fp32 load dequantizes (a second
    rounding would move them), the tied output the embedding's Q8_0; and at rows that the fp32
    kernels take (below BF16_ROWS, x not in int8), the logits are the fp32 model's but for the
    order of the sums."""
    import block_quant
    from block_quant import BF16_ROWS, BlockLinear

    monkeypatch.setattr(block_quant, "INT8_X", False)

    path = files[name][2]
    full = llama2.tp_llama(None, path, TOKENIZER, 1, max_batch_size=1, max_seq_len=32).model
    quantized = llama2.tp_llama(None, path, TOKENIZER, 1, max_batch_size=1, max_seq_len=32,
                                quantization=quantization).model
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, BlockLinear)}
    assert len(layers) == 4 * 2 + 1
    for n, layer in layers.items():
        assert torch.equal(layer.dequantize(), full.get_submodule(n).weight), n
    tokens = long_tokens(full.vocab_size)[:, :min(BF16_ROWS.values()) - 1]
    want = full(tokens, 0)
    assert (quantized(tokens, 0) - want).abs().max() <= 1e-5 * (want.max() - want.min())


@pytest.mark.slow
def test_quantization_keeps_the_files_blocks_at_tp2(files, tmp_path):
    """Each rank's shard of the file's blocks: rows of the column-parallel projections, the
    columns (32 wide blocks) of the row-parallel ones."""
    for rank in run("blocks_worker.py", 2, tmp_path, files["q4"][2], "int4", TOKENIZER):
        assert len(rank) == 4 * 2 + 1
        for n, (w, full) in rank.items():
            assert torch.equal(w, full), n


# --- refused by name, before TorchServe starts and when loading ------------------------------

def variant(files, tmp_path, metadata: dict = {}, tensors: dict = {}, without: tuple = ()) -> str:
    """The Llama 3-style file written again with metadata and tensors added or replaced, and
    the tensors in without left out."""
    model = files["llama3"][0]
    path = str(tmp_path / "variant.gguf")
    kept = {k: v for k, v in make_checkpoint.gguf_tensors(model).items() if k not in without}
    make_checkpoint.write_gguf(path, make_checkpoint.gguf_metadata(model) | metadata, kept | tensors)
    return path


def refused(path: str) -> str:
    """The loader's refusal of path, after checkpoint.inspect's (the same)."""
    with pytest.raises(checkpoint.CheckpointError) as inspected:
        checkpoint.inspect(path)
    with pytest.raises(checkpoint.CheckpointError) as loaded:
        load(path)
    assert str(loaded.value) == str(inspected.value)
    return str(loaded.value)


def q5_0(shape) -> tuple:
    return quantize(np.random.default_rng(0).standard_normal(shape, dtype=np.float32), Q.Q5_0), Q.Q5_0


F32 = Q.F32
# case: (metadata, tensors, left out, what the refusal says)
REFUSALS = {
    "architecture": ({"general.architecture": "qwen2"}, {}, (), "architecture 'qwen2' is not implemented"),
    "tensor type": ({}, {"blk.0.attn_q.weight": q5_0((64, 64))}, (),
                    "tensor blk.0.attn_q.weight has type Q5_0, which this model does not read"),
    "experts": ({"llama.expert_count": 8}, {}, (), "llama.expert_count 8 (a mixture of experts) is not implemented"),
    "rope dimensions": ({"llama.rope.dimension_count": 4}, {}, (), "llama.rope.dimension_count 4 (not "),
    "rope scaling type": ({"llama.rope.scaling.type": "linear"}, {}, (), "rope scaling of type 'linear'"),
    "rope divisors": ({}, {"rope_freqs.weight": (np.full(4, 2.0, np.float32), F32)}, (),
                      "rope_freqs.weight holds RoPE divisors that are not Llama 3's scaling"),
    "attention bias": ({}, {"blk.0.attn_q.bias": (np.zeros(64, np.float32), F32)}, (),
                       "tensor blk.0.attn_q.bias is not implemented"),
    "unknown metadata": ({"llama.attention.sliding_window": 128}, {}, (),
                         "metadata ['llama.attention.sliding_window'] is not implemented"),
    "per-layer KV heads": ({"llama.attention.head_count_kv": [2, 2]}, {}, (),
                           "llama.attention.head_count_kv is an array"),
    "split file": ({"split.count": 2}, {}, (), "a GGUF split into 2 files"),
    "missing tensor": ({}, {}, ("blk.1.ffn_down.weight",), "tensors ['blk.1.ffn_down.weight'] are missing"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_the_model_does_not_implement_is_refused_by_name(files, tmp_path, case):
    metadata, tensors, without, words = REFUSALS[case]
    path = variant(files, tmp_path, metadata, tensors, without)
    message = refused(path)
    assert message.startswith(f"{path}: ") and words in message, message


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("not a model\n" * 100)
    assert f"{path} is not a GGUF file that can be read" in refused(str(path))


@pytest.mark.parametrize("field", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
def test_an_array_longer_than_the_file_is_refused_at_once(files, tmp_path, field):
    """A metadata array (the vocabulary's strings, its token types) whose count says more items
    than the file holds: refused as unreadable, in well under a second, not read for ever."""
    from gguf_checkpoint import Reader

    path = str(tmp_path / "corrupt.gguf")
    shutil.copy(files["typed"][2], path)
    start = Reader(path).fields[field].offset + 8 + len(field) + 4 + 4  # key, value type, item type
    with open(path, "r+b") as f:
        f.seek(start)
        f.write((1 << 62).to_bytes(8, "little"))
    began = time.process_time()
    assert f"{path} is not a GGUF file that can be read (ValueError: array of {1 << 62} " in refused(path)
    assert time.process_time() - began < 1


def cannot_serve(path: str, tmp_path, monkeypatch, capsys, *options: str) -> str:
    line = configure_line(path, tmp_path, monkeypatch, capsys, "--tokenizer", TOKENIZER, *options)
    assert line.startswith("cannot serve: ") and "\n" not in line, line
    return line


@pytest.mark.slow  # runs tools/configure.py
def test_make_serves_check_refuses_a_truncated_file_in_seconds(files, tmp_path, monkeypatch, capsys):
    """SmolLM2's file cut at two thirds: its header and tensor table are whole, the data of the
    tensors past the cut is not (the check reads the header's 98,000 tokens and merges: 2 s
    here with gguf's own reading, 0.3 s with gguf_checkpoint.Reader's). The loader refuses a
    cut file alike."""
    path = str(tmp_path / "smollm2.gguf")
    with open(SMOLLM2, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(os.path.getsize(SMOLLM2) * 2 // 3))
    start = time.perf_counter()
    line = cannot_serve(path, tmp_path, monkeypatch, capsys)
    assert time.perf_counter() - start < 20
    assert f"{path} is truncated or its tensor table corrupt: tensor " in line and "ends at byte" in line, line
    cut = str(tmp_path / "cut.gguf")
    shutil.copy(files["typed"][2], cut)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) - 1000)
    assert f"{cut} is truncated or its tensor table corrupt: tensor output.weight ends at byte" in refused(cut)


@pytest.mark.slow  # runs tools/configure.py
def test_make_serves_check_refuses_what_the_model_does_not_implement(files, tmp_path, monkeypatch, capsys):
    for case in ("tensor type", "architecture"):
        metadata, tensors, _, words = REFUSALS[case]
        assert words in cannot_serve(variant(files, tmp_path, metadata, tensors), tmp_path, monkeypatch, capsys)


@pytest.mark.slow  # runs tools/configure.py
def test_make_serves_check_sees_the_files_heads_and_context(files, tmp_path, monkeypatch, capsys):
    """TP=2 does not divide SmolLM2's 9 heads; the Llama 3-style file passes at TP=2, served in
    place (an absolute path, as a folder is), and its context_length (512) bounds
    handler.max_seq_len. The check reads no weights."""
    def read_into(*args):
        raise AssertionError("the check read weights")

    monkeypatch.setattr(GGUFCheckpoint, "read_into", read_into)
    line = cannot_serve(SMOLLM2, tmp_path, monkeypatch, capsys, "--tp", "2")
    assert f"TP=2 does not fit the model in {SMOLLM2} (9 heads, 3 KV heads)" in line, line
    path = files["llama3"][2]
    line = cannot_serve(path, tmp_path, monkeypatch, capsys, "--tp", "2", "--set", "handler.max_seq_len=1024")
    assert "handler.max_seq_len 1024 is beyond the 512 positions" in line and "context_length" in line, line
    line = configure_line(path, tmp_path, monkeypatch, capsys, "--tokenizer", TOKENIZER, "--tp", "2")
    assert line.startswith(f"checked {path}: 2 layers, 8 heads, 2 KV heads"), line
    with open(tmp_path / "build" / "model-config.yaml") as f:
        handler = yaml.safe_load(f)["handler"]
    assert (handler["checkpoint"], handler["tokenizer"]) == (path, TOKENIZER)


@pytest.mark.slow
def test_make_serve_refuses_a_gguf_file_in_seconds(files, tmp_path):
    """`make serve CKPT=file.gguf` reaches the check with the file, and stops there."""
    path = str(tmp_path / "cut.gguf")
    shutil.copy(files["typed"][2], path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    server = Server(str(tmp_path / "ts"), tp=2)
    try:
        status, output, seconds = server.make_serve(f"CKPT={path}", f"TOKENIZER={TOKENIZER}", timeout=120)
        refusal = [line for line in output.splitlines() if line.startswith("cannot serve: ")]
        assert status != 0 and refusal and f"{path} is truncated" in refusal[0], output[-2000:]
        assert not os.path.exists(os.path.join(server.workdir, "logs")), "TorchServe was started"
        assert no_torchserve_left(server)
    finally:
        server.stop()
