"""What a checkpoint's files say cannot make the server read outside them: index entries that
are paths, not file names in the folder, and safetensors headers whose tensors lie outside
their file are refused by `make serve`'s tools/configure.py (one line, before TorchServe
starts) and by the loader a worker runs; Hugging Face's cache folders, whose files are
symlinks into ../../blobs/, load as the plain folder does."""

import json
import os
import shutil
import struct

import pytest
import torch

import checkpoint
import llama2
import make_checkpoint
from conftest import CONFIGS, TOKENIZER, configure_line
from runner import ModelRunner
from tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"
TENSOR = "model.layers.0.self_attn.q_proj.weight"  # the tensor whose offsets the tests break


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    """A tiny Hugging Face folder: several safetensors files, their index, tokenizer.model."""
    dim, layers, heads, kv_heads = CONFIGS["gqa"]
    model = make_checkpoint.random_hf_model(dim, layers, heads, kv_heads, Tokenizer(TOKENIZER).n_words, seed=5)
    out = str(tmp_path_factory.mktemp("sharded"))
    return make_checkpoint.write_layouts(model, out, TOKENIZER, ["hf"], hf_shard_size="200KB")["hf"]


@pytest.fixture
def folder(sharded, tmp_path) -> str:
    """A copy of sharded, to break."""
    return str(shutil.copytree(sharded, tmp_path / "ckpt"))


def load(folder: str) -> ModelRunner:
    return llama2.tp_llama(None, folder, TOKENIZER, 1).runner


def refusals(folder: str, tmp_path, monkeypatch, capsys) -> list[str]:
    """[configure.py's line, the loader's CheckpointError] for folder; both must refuse it."""
    line = configure_line(folder, tmp_path, monkeypatch, capsys)
    assert line.startswith("cannot serve: ") and "\n" not in line, line
    with pytest.raises(checkpoint.CheckpointError) as e:
        load(folder)
    return [line, str(e.value)]


def weight_map(folder: str) -> dict:
    with open(os.path.join(folder, INDEX)) as f:
        return json.load(f)["weight_map"]


# --- index entries ----------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder"])
def test_index_entries_that_are_paths_are_refused(folder, tmp_path, monkeypatch, capsys, where):
    """The shard is moved where the entry says, whole: only the name check stands between the
    index and a file outside the folder."""
    index = weight_map(folder)
    name = index[TENSOR]
    entry = {"parent": f"../{name}", "absolute": str(tmp_path / name), "subfolder": f"sub/{name}"}[where]
    target = os.path.join(folder, entry)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(os.path.join(folder, name), target)
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"weight_map": {t: entry if file == name else file for t, file in index.items()}}, f)
    for message in refusals(folder, tmp_path, monkeypatch, capsys):
        assert os.path.join(folder, INDEX) in message and repr(entry) in message, message
        assert "is not a file name in the checkpoint folder" in message, message


def hf_cache(folder: str, repo) -> str:
    """folder as Hugging Face's cache holds a download: each file a blob in repo/blobs/, and
    repo/snapshots/<revision>/ relative symlinks to them."""
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123456789abcdef"
    os.makedirs(blobs)
    os.makedirs(snapshot)
    for i, name in enumerate(sorted(os.listdir(folder))):
        blob = f"{i:064x}"  # the cache names blobs by their hash; any unique name does here
        shutil.copy(os.path.join(folder, name), blobs / blob)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    return str(snapshot)


def test_hugging_face_cache_folder_loads_as_the_plain_one(sharded, tmp_path, monkeypatch, capsys):
    cached = hf_cache(sharded, tmp_path / "models--tiny")
    assert os.path.islink(os.path.join(cached, INDEX))
    assert all(os.path.islink(os.path.join(cached, name)) for name in weight_map(cached).values())
    assert configure_line(cached, tmp_path, monkeypatch, capsys).startswith(f"checked {cached}:")
    plain, linked = load(sharded), load(cached)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), linked.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, plain.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain(tokens, 0), linked(tokens, 0))


# --- safetensors headers ----------------------------------------------------------------------

def rewrite_header(path: str, tensor: str, offsets):
    """Give tensor in the safetensors file at path the data_offsets offsets(begin, end, data
    size); the data stays as it is."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header[tensor]["data_offsets"] = offsets(*header[tensor]["data_offsets"], len(data))
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


# case: (the tensor's new data_offsets from its (begin, end) and the data's size, the reason given).
# Each breaks one condition only: the size stays right where the bounds are wrong.
OFFSETS = {
    "past-the-end": (lambda begin, end, size: [begin + size, end + size], "is truncated or its header corrupt"),
    "negative": (lambda begin, end, size: [begin - end, 0], "not 0 <= begin <= end"),
    "begin-after-end": (lambda begin, end, size: [end, begin], "not 0 <= begin <= end"),
    "wrong-size": (lambda begin, end, size: [begin, end - 4], "its dtype F32 and shape"),
}


@pytest.mark.parametrize("case", list(OFFSETS))
def test_tensor_offsets_outside_the_file_or_the_tensor_are_refused(folder, tmp_path, monkeypatch, capsys, case):
    offsets, reason = OFFSETS[case]
    path = os.path.join(folder, weight_map(folder)[TENSOR])
    rewrite_header(path, TENSOR, offsets)
    for message in refusals(folder, tmp_path, monkeypatch, capsys):
        assert path in message and TENSOR in message and reason in message, message


def test_a_file_that_is_not_safetensors_is_refused_by_its_header_length(folder, tmp_path, monkeypatch, capsys):
    """Its first 8 bytes, read as a header length, are far beyond the file: refused before
    anything that size is read or allocated."""
    path = os.path.join(folder, weight_map(folder)[TENSOR])
    with open(path, "wb") as f:
        f.write(b"root:x:0:0:root:/root:/bin/bash\n" * 64)
    for message in refusals(folder, tmp_path, monkeypatch, capsys):
        assert f"{path} is not a safetensors file (its first 8 bytes give a header length of" in message, message
