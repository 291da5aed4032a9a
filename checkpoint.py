"""Checkpoint folders in Meta's layout (params.json + consolidated.NN.pth, any model-parallel
size) and Hugging Face's (config.json + *.safetensors): their model arguments, tensor names
and shards, and the slices of them (Pieces) that a weight plan loads into a model. Both are
read through memory maps, so a rank touches only the slices it keeps; the files themselves
are opened and checked by weight_files.py (nothing is unpickled beyond plain tensors).
A checkpoint that is a file, not a folder, is a GGUF file (gguf_checkpoint.py)."""

import dataclasses
import glob
import json
import os
import re

import torch

import gguf_checkpoint
from model import META_ROPE_SCALING
from weight_files import CheckpointError, SafetensorsFile, check_zip, load_pth, safetensors_header
from weight_plan import Checkpoint, Piece, check_shape, narrow


def open_checkpoint(path: str) -> Checkpoint:
    """The reader of a checkpoint folder, a GGUF file, or a Meta .pth file (params.json beside it)."""
    if is_gguf(path):
        return gguf_checkpoint.GGUFCheckpoint(path)
    return MetaCheckpoint(path) if is_meta(path) else HFCheckpoint(path)


def is_gguf(path: str) -> bool:
    """Whether path is a file to read as GGUF: any file but a Meta .pth (the seed's checkpoint_path)."""
    return os.path.isfile(path) and not path.endswith(".pth")


def is_meta(folder: str) -> bool:
    """True for Meta's layout (a folder, or one of its .pth files: the seed's
    checkpoint_path), False for Hugging Face's; a folder in neither raises."""
    if os.path.isfile(folder) and folder.endswith(".pth"):
        folder = os.path.dirname(folder)
    elif not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder not found: {folder}")
    if os.path.isfile(os.path.join(folder, "params.json")):
        return True
    if os.path.isfile(os.path.join(folder, "config.json")):
        return False
    raise CheckpointError(f"{folder} holds neither params.json (Meta layout) nor config.json (Hugging Face layout)")


def inspect(path: str) -> tuple[dict, int | None]:
    """(model arguments, the context length the checkpoint was made for, None where it does
    not say) of the checkpoint at path, after checking that its weights files are all there
    and none is cut short. Reads the JSON files, safetensors headers, the .pth files' zip
    directories and a GGUF file's header and tensor table, no weights: this is the check
    before a server starts."""
    if is_gguf(path):
        return gguf_checkpoint.inspect(path)
    if is_meta(path):
        args = meta_params(path)
        for shard in meta_shards(path):
            check_zip(shard)
        return args, None  # Meta's params.json does not record it
    args, config = hf_config(path)
    for file in safetensors_paths(path):
        safetensors_header(file)
    return args, config.get("max_position_embeddings")


# --- Meta layout -----------------------------------------------------------------------

META_ARGS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
             "ffn_dim_multiplier", "norm_eps", "rope_theta", "max_batch_size", "max_seq_len"}

# The dim along which fairscale's model parallelism splits each weight; absent: replicated.
# tok_embeddings: Llama 2 splits it over dim 1, Llama 3 over the vocabulary (dim 0); see
# MetaCheckpoint.split_dim.
MP_SPLIT_DIM = {"tok_embeddings": 1, "output": 0, "wq": 0, "wk": 0, "wv": 0, "wo": 1,
                "w1": 0, "w3": 0, "w2": 1}

def meta_model_args(params: dict, path: str) -> dict:
    """params.json's arguments; use_scaled_rope means Meta's constants (META_ROPE_SCALING),
    with the factor of rope_scaling_factor where given (Llama 3.2 1B/3B were trained with 32)."""
    params = dict(params)
    scaled = params.pop("use_scaled_rope", False)
    factor = params.pop("rope_scaling_factor", None)
    unknown = set(params) - META_ARGS
    if unknown:
        raise CheckpointError(f"{path}: unsupported parameters {sorted(unknown)}")
    params.pop("max_batch_size", None)
    params.pop("max_seq_len", None)
    if scaled:
        params["rope_scaling"] = META_ROPE_SCALING | ({"factor": float(factor)} if factor else {})
    return params


def meta_params(path: str) -> dict:
    params_path = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "params.json")
    with open(params_path) as f:
        return meta_model_args(json.load(f), params_path)


def meta_shards(folder: str) -> list[str]:
    """consolidated.00.pth, .01, ... with none missing; or the one .pth file named."""
    if os.path.isfile(folder):
        return [folder]
    paths = sorted(glob.glob(os.path.join(folder, "consolidated.*.pth")))
    if not paths:
        raise CheckpointError(f"no consolidated.NN.pth files in {folder}")
    for i, path in enumerate(paths):
        expected = os.path.join(folder, f"consolidated.{i:02d}.pth")
        if path != expected:
            raise CheckpointError(f"missing shard {expected} (found {[os.path.basename(p) for p in paths]})")
    return paths


class MetaCheckpoint(Checkpoint):
    def __init__(self, folder: str):
        self.folder = folder
        self.model_args = meta_params(folder)
        self.paths = meta_shards(folder)
        self.shards = [load_pth(p) for p in self.paths]
        # Llama 3.2 1B/3B tie the output projection to the embedding
        self.tied = "output.weight" not in self.shards[0] and "tok_embeddings.weight" in self.shards[0]
        self.model_args["tie_word_embeddings"] = self.tied

    def tensor(self, piece: Piece) -> torch.Tensor:
        if self.tied and piece.name == "output.weight":
            piece = dataclasses.replace(piece, name="tok_embeddings.weight")
        parts = []
        for path, shard in zip(self.paths, self.shards):
            if piece.name not in shard:
                raise CheckpointError(f"tensor {piece.name} is missing from {path}")
            parts.append(shard[piece.name])
        split = self.split_dim(piece, parts)
        if split is None:
            for path, part in zip(self.paths, parts):
                check_shape(piece, part.shape, path)
            return narrow(parts[0], piece)
        for path, part in zip(self.paths, parts):
            shard_shape = list(piece.shape)
            shard_shape[split] //= len(parts)
            if list(part.shape) != shard_shape:
                # Meta's files do not record their number; a shard that holds 1/n of the
                # tensor, n > the files found, means the last ones are missing.
                n = piece.shape[split] // max(part.shape[split], 1)
                one_nth = [*piece.shape[:split], part.shape[split], *piece.shape[split + 1:]]
                hint = ""
                if n > len(parts) and list(part.shape) == one_nth and part.shape[split] * n == piece.shape[split]:
                    missing = [f"consolidated.{i:02d}.pth" for i in range(len(parts), n)]
                    hint = f"; its shape implies {n} shards, {self.folder} holds {len(parts)}: missing {missing}"
                raise CheckpointError(f"tensor {piece.name} in {path} has shape {tuple(part.shape)}, the model "
                                      f"needs {tuple(shard_shape)} per shard of {len(parts)} (full {piece.shape})"
                                      + hint)
        return slice_of_concatenation(parts, split, piece)

    @staticmethod
    def split_dim(piece: Piece, parts: list[torch.Tensor]) -> int | None:
        kind = piece.name.split(".")[-2]
        if kind == "tok_embeddings" and len(parts) > 1 and parts[0].shape[0] * len(parts) == piece.shape[0]:
            return 0  # Llama 3's VocabParallelEmbedding
        return MP_SPLIT_DIM.get(kind)


def slice_of_concatenation(parts: list[torch.Tensor], cat_dim: int, piece: Piece) -> torch.Tensor:
    """piece's slice of torch.cat(parts, cat_dim), reading only the parts it overlaps."""
    if len(parts) == 1:  # one file: a view into it, no copy
        return narrow(parts[0], piece)
    if piece.dim is None or piece.dim != cat_dim:
        return torch.cat([narrow(p, piece) for p in parts], cat_dim)
    out, offset = [], 0
    for p in parts:
        n = p.shape[cat_dim]
        lo, hi = max(piece.start, offset), min(piece.end, offset + n)
        if lo < hi:
            out.append(p.narrow(cat_dim, lo - offset, hi - lo))
        offset += n
    return out[0] if len(out) == 1 else torch.cat(out, cat_dim)


# --- Hugging Face layout ---------------------------------------------------------------

HF_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
            "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def hf_name(name: str, tied: bool) -> str:
    """Meta name -> Hugging Face name."""
    if name == "tok_embeddings.weight" or (name == "output.weight" and tied):
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    return f"model.layers.{m[1]}.{HF_NAMES[m[2]]}.weight"


def hf_model_args(config: dict, path: str) -> dict:
    def refuse(what):
        raise CheckpointError(f"{path}: {what} is not implemented by this model")

    if config.get("model_type") != "llama":
        refuse(f"model_type {config.get('model_type')!r}")
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {config['hidden_act']!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            refuse(flag)
    rope_theta, rope_scaling = hf_rope(config, refuse)
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // n_heads):
        refuse(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    return {"dim": dim, "n_layers": config["num_hidden_layers"], "n_heads": n_heads,
            "n_kv_heads": config.get("num_key_value_heads") or n_heads,
            "vocab_size": config["vocab_size"], "intermediate_size": config["intermediate_size"],
            "norm_eps": config.get("rms_norm_eps", 1e-6), "rope_theta": rope_theta, "rope_scaling": rope_scaling,
            "max_position_embeddings": config.get("max_position_embeddings"),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_rope(config: dict, refuse) -> tuple[float, dict | None]:
    """(theta, llama3 scaling or None) from config.json: the Hub's rope_scaling and
    rope_theta, or transformers 5's rope_parameters."""
    rope = (config.get("rope_parameters") or {}) | (config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        refuse(f"rope scaling of type {rope_type!r}")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
    if missing:
        refuse(f"rope scaling llama3 without {missing}")
    return theta, {k: rope[k] for k in LLAMA3_ROPE_KEYS}


def hf_config(folder: str) -> tuple[dict, dict]:
    """(model arguments, config.json)"""
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    return hf_model_args(config, config_path), config


def safetensors_paths(folder: str) -> list[str]:
    """The files that model.safetensors.index.json lists, all there, or every *.safetensors."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        paths = [os.path.join(folder, name) for name in index_file_names(index_path)]
        for path in paths:
            if not os.path.isfile(path):
                raise CheckpointError(f"missing shard {path} (listed in {index_path})")
        return paths
    paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    return paths


def index_file_names(index_path: str) -> list[str]:
    """The file names that the index's weight_map lists, each a plain name in the index's
    folder: an entry with a path could make the server read any file. The name is checked,
    not where it leads: Hugging Face's cache links snapshots/<rev>/ files into ../../blobs/."""
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    for tensor, name in weight_map.items():
        if not (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name):
            raise CheckpointError(f"{index_path}: the file of tensor {tensor}, {name!r}, is not a file name "
                                  f"in the checkpoint folder (paths are refused)")
    return sorted(set(weight_map.values()))


class HFCheckpoint(Checkpoint):
    def __init__(self, folder: str):
        self.folder = folder
        self.model_args, _ = hf_config(folder)
        self.tied = self.model_args["tie_word_embeddings"]
        self.files = {os.path.basename(p): SafetensorsFile(p) for p in safetensors_paths(folder)}
        self.location = {t: f for f in self.files.values() for t in f.header}
        self.n_heads, self.n_kv_heads = self.model_args["n_heads"], self.model_args["n_kv_heads"]

    def tensor(self, piece: Piece) -> torch.Tensor:
        name = hf_name(piece.name, self.tied)
        file = self.location.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name} ({piece.name}) is missing from {self.folder}")
        t = file.tensor(name)
        check_shape(piece, t.shape, f"{file.path} ({name})")
        t = narrow(t, piece)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = unpermute_rotary(t, self.model_args["dim"] // self.n_heads)
        return t


def unpermute_rotary(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undo the per-head permutation that Hugging Face's conversion applies to q and k rows
    (halves -> Meta's interleaved pairs). Works on any head-aligned slice of rows."""
    rows, cols = w.shape
    return w.view(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)
