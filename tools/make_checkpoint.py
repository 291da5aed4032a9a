"""Write small random Llama checkpoints in Hugging Face and Meta layouts, from one set of
weights, for tests and benchmarks. The weights come from transformers' LlamaForCausalLM
(the numerical reference); the Meta layout is derived from them the way Meta's and Hugging
Face's conversion scripts relate the two (rotary permutation, fairscale splits).

    python tools/make_checkpoint.py OUT --tokenizer demo/tokenizer.model --dim 512 --layers 8 \
        --heads 8 --kv-heads 8 --layouts hf meta:1 meta:2
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import HF_NAMES, MP_SPLIT_DIM, unpermute_rotary  # noqa: E402
from llama2 import meta_ffn_hidden_dim  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def random_hf_model(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int,
                    multiple_of: int = 32, ffn_dim_multiplier: float | None = None, norm_eps: float = 1e-5,
                    rope_theta: float = 10000.0, tie: bool = False, seed: int = 0, max_positions: int = 4096):
    """A LlamaForCausalLM with weights scaled so that attention is far from uniform (so that
    rotary and head-layout mistakes show in the logits) and norms that are not all ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=dim, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                         num_key_value_heads=n_kv_heads, vocab_size=vocab_size,
                         intermediate_size=meta_ffn_hidden_dim(4 * dim, multiple_of, ffn_dim_multiplier),
                         rms_norm_eps=norm_eps, rope_theta=rope_theta, tie_word_embeddings=tie,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
    model.meta_params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
                         "vocab_size": vocab_size, "multiple_of": multiple_of,
                         "ffn_dim_multiplier": ffn_dim_multiplier, "norm_eps": norm_eps, "rope_theta": rope_theta}
    return model


def meta_state_dict(model) -> dict:
    """Meta-named, Meta-laid-out tensors of a Hugging Face Llama."""
    hf = model.state_dict()
    p = model.meta_params
    head_dim = p["dim"] // p["n_heads"]
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
           "output.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"])}
    for i in range(p["n_layers"]):
        for meta, hf_part in HF_NAMES.items():
            w = hf[f"model.layers.{i}.{hf_part}.weight"]
            if meta in ("attention.wq", "attention.wk"):
                w = unpermute_rotary(w, head_dim)
            out[f"layers.{i}.{meta}.weight"] = w
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def save_meta(model, folder: str, mp: int = 1, dtype: torch.dtype = torch.float32):
    """params.json + consolidated.NN.pth split as fairscale's model parallelism splits them."""
    os.makedirs(folder, exist_ok=True)
    state = meta_state_dict(model)
    for rank in range(mp):
        shard = {}
        for name, t in state.items():
            dim = MP_SPLIT_DIM.get(name.split(".")[-2])
            part = t if dim is None else t.chunk(mp, dim=dim)[rank]
            shard[name] = part.to(dtype).clone()
        shard["rope.freqs"] = torch.zeros(1)  # present in Meta's files; loaders must ignore it
        torch.save(shard, os.path.join(folder, f"consolidated.{rank:02d}.pth"))
    with open(os.path.join(folder, "params.json"), "w") as f:
        json.dump({k: v for k, v in model.meta_params.items() if v is not None}, f, indent=2)


def save_hf(model, folder: str, max_shard_size: str | None = None):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)


def write_layouts(model, out: str, tokenizer_path: str, layouts: list[str], hf_shard_size: str | None = None) -> dict:
    """Write each layout ('hf' or 'meta:MP') under out/; returns {layout: folder}."""
    folders = {}
    for layout in layouts:
        folder = os.path.join(out, layout.replace(":", "_mp"))
        if layout == "hf":
            save_hf(model, folder, hf_shard_size)
        else:
            save_meta(model, folder, mp=int(layout.split(":")[1]))
        shutil.copy(tokenizer_path, os.path.join(folder, "tokenizer.model"))
        folders[layout] = folder
    return folders


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "..", "demo", "tokenizer.model"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--multiple-of", type=int, default=32)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", nargs="+", default=["hf", "meta:1", "meta:2"])
    ap.add_argument("--hf-shard-size", default=None, help="e.g. 200KB: several safetensors files + index")
    a = ap.parse_args()
    vocab = Tokenizer(a.tokenizer).n_words
    model = random_hf_model(a.dim, a.layers, a.heads, a.kv_heads or a.heads, vocab, a.multiple_of,
                            tie=a.tie, seed=a.seed)
    for layout, folder in write_layouts(model, a.out, a.tokenizer, a.layouts, a.hf_shard_size).items():
        print(f"{layout}: {folder}")


if __name__ == "__main__":
    main()
