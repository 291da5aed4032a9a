"""Write small random Llama checkpoints in Hugging Face and Meta layouts and as GGUF files,
from one set of weights, for tests and benchmarks. The weights come from transformers'
LlamaForCausalLM (the numerical reference); the Meta layout is derived from them the way
Meta's and Hugging Face's conversion scripts relate the two (rotary permutation, fairscale
splits), and GGUF the way llama.cpp's convert_hf_to_gguf.py writes a Llama.

    python tools/make_checkpoint.py OUT --tokenizer demo/tokenizer.model --dim 512 --layers 8 \
        --heads 8 --kv-heads 8 --layouts hf meta:1 meta:2
"""

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import HF_NAMES, META_ROPE_SCALING, MP_SPLIT_DIM, unpermute_rotary  # noqa: E402
from model import meta_ffn_hidden_dim  # noqa: E402
from tokenizer import LLAMA3_PATTERN, Tokenizer, llama3_special_tokens, write_tiktoken_ranks  # noqa: E402


def random_hf_model(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int,
                    multiple_of: int = 32, ffn_dim_multiplier: float | None = None, norm_eps: float = 1e-5,
                    rope_theta: float = 10000.0, tie: bool = False, seed: int = 0, max_positions: int = 4096,
                    rope_scaling: dict | None = None, bos_id: int = 1, eos_id: int | list[int] = 2):
    """A LlamaForCausalLM with weights scaled so that attention is far from uniform (so that
    rotary and head-layout mistakes show in the logits) and norms that are not all ones.
    rope_scaling: Llama 3.1's (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), or None."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", **rope_scaling} if rope_scaling else None
    config = LlamaConfig(hidden_size=dim, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                         num_key_value_heads=n_kv_heads, vocab_size=vocab_size,
                         intermediate_size=meta_ffn_hidden_dim(4 * dim, multiple_of, ffn_dim_multiplier),
                         rms_norm_eps=norm_eps, rope_theta=rope_theta, rope_scaling=rope, tie_word_embeddings=tie,
                         max_position_embeddings=max_positions, bos_token_id=bos_id, eos_token_id=eos_id)
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
    if rope_scaling:  # Meta's params.json can only say: Meta's constants, perhaps another factor
        if {k: v for k, v in rope_scaling.items() if k != "factor"} == \
                {k: v for k, v in META_ROPE_SCALING.items() if k != "factor"}:
            model.meta_params |= {"use_scaled_rope": True, "rope_scaling_factor": rope_scaling["factor"]}
        else:
            model.meta_params = None  # no Meta layout for this model
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


def save_meta(model, folder: str, mp: int = 1, dtype: torch.dtype = torch.float32, llama3: bool = False):
    """params.json + consolidated.NN.pth split as fairscale's model parallelism splits them.
    llama3: the embedding split over the vocabulary (Llama 3's VocabParallelEmbedding), and
    no output.weight when it is tied to the embedding (Llama 3.2 1B/3B)."""
    if model.meta_params is None:
        raise ValueError("this model's RoPE scaling cannot be written in Meta's params.json")
    os.makedirs(folder, exist_ok=True)
    state = meta_state_dict(model)
    if llama3 and model.config.tie_word_embeddings:
        del state["output.weight"]
    for rank in range(mp):
        shard = {}
        for name, t in state.items():
            dim = 0 if llama3 and name == "tok_embeddings.weight" else MP_SPLIT_DIM.get(name.split(".")[-2])
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


# --- GGUF, as llama.cpp's convert_hf_to_gguf.py writes a Llama ----------------------------

GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, part = hf_name.removesuffix(".weight").split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[part]}.weight"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q and k rows (n_head: the KV heads for
    k). Rows move whole, so it applies to a quantized tensor's rows of blocks alike."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(config) -> np.ndarray:
    """rope_freqs.weight: each frequency's divisor, computed as the converter's
    LlamaModel.generate_extra_tensors computes it for rope_type llama3."""
    scaling, dim = config.rope_parameters, config.hidden_size // config.num_attention_heads
    base = scaling["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            divisors.append(1)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def gguf_metadata(model, vocab_size: bool = True) -> dict:
    """The llama.* metadata the converter writes for model (vocab_size: with llama.vocab_size,
    which older converters left out)."""
    c = model.config
    meta = {"general.architecture": "llama", "llama.block_count": c.num_hidden_layers,
            "llama.context_length": c.max_position_embeddings, "llama.embedding_length": c.hidden_size,
            "llama.feed_forward_length": c.intermediate_size, "llama.attention.head_count": c.num_attention_heads,
            "llama.attention.head_count_kv": c.num_key_value_heads,
            "llama.rope.freq_base": float(c.rope_parameters["rope_theta"]),
            "llama.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
            "llama.rope.dimension_count": c.hidden_size // c.num_attention_heads}
    return meta | ({"llama.vocab_size": c.vocab_size} if vocab_size else {})


def gguf_tensors(model, blocks: dict | None = None) -> dict:
    """{GGUF name: (data, ggml type)}: model's weights under GGUF names, q and k rows
    permuted; F32 but where blocks ({GGUF name: (blocks, type)}, from quantize_weights)
    gives a tensor's blocks; no output.weight when tied; rope_freqs.weight for llama3 RoPE."""
    from gguf import GGMLQuantizationType

    blocks, c = blocks or {}, model.config
    out = {}
    for hf_name, w in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = gguf_name(hf_name)
        data, qtype = blocks.get(name, (w.detach().float().numpy(), GGMLQuantizationType.F32))
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        out[name] = (data, qtype)
    if c.rope_parameters["rope_type"] == "llama3":
        out["rope_freqs.weight"] = (llama3_rope_freqs(c), GGMLQuantizationType.F32)
    return out


def sentencepiece_vocab(path: str) -> dict:
    """The tokenizer.ggml.* metadata of a sentencepiece model, as the converter's
    _set_vocab_sentencepiece writes it."""
    import sentencepiece
    from gguf import TokenType

    sp = sentencepiece.SentencePieceProcessor(model_file=path)

    def token_type(i: int) -> int:
        kinds = [(sp.IsUnknown, TokenType.UNKNOWN), (sp.IsControl, TokenType.CONTROL),
                 (sp.IsUnused, TokenType.UNUSED), (sp.IsByte, TokenType.BYTE)]
        return next((kind for is_kind, kind in kinds if is_kind(i)), TokenType.NORMAL).value

    n = sp.vocab_size()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [sp.IdToPiece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.GetScore(i) for i in range(n)],
            "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}


def write_gguf(path: str, metadata: dict, tensors: dict):
    """A GGUF file: metadata {key: value} (int: uint32, float: float32, as the converter
    writes them) with general.architecture's value as the architecture; tensors as
    gguf_tensors gives them."""
    from gguf import GGUFValueType, GGUFWriter

    metadata = dict(metadata)
    writer = GGUFWriter(path, metadata.pop("general.architecture"))
    types = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
             str: GGUFValueType.STRING, list: GGUFValueType.ARRAY}
    for key, value in metadata.items():
        writer.add_key_value(key, value, types[type(value)])
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_gguf(model, path: str, tokenizer_path: str | None = None, blocks: dict | None = None,
              vocab_size: bool = True):
    """model as one GGUF file (see gguf_metadata, gguf_tensors), with tokenizer_path's
    vocabulary (a sentencepiece model) when given."""
    vocab = sentencepiece_vocab(tokenizer_path) if tokenizer_path else {}
    write_gguf(path, gguf_metadata(model, vocab_size) | vocab, gguf_tensors(model, blocks))


def quantize_weights(model, types: dict, seed: int = 0) -> dict:
    """{GGUF name: (blocks, type)} for the tensors that types ({GGUF name: ggml type}) names,
    each quantized by gguf.quants.quantize, or random blocks for the K-quants (gguf can
    dequantize them, not quantize to them); model's weights become those blocks dequantized
    (gguf.quants.dequantize), the reference the GGUF file must load as. Rows stay in
    Hugging Face's order: gguf_tensors permutes q and k rows of blocks as it does floats."""
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    blocks = {}
    with torch.no_grad():
        for hf_name, p in model.named_parameters():
            qtype = types.get(gguf_name(hf_name))
            if qtype is None:
                continue
            w = p.detach().float().numpy()
            data = random_k_blocks(w.shape, qtype, rng) if qtype.name.endswith("_K") else quantize(w, qtype)
            p.copy_(torch.from_numpy(dequantize(data, qtype).reshape(w.shape)))
            blocks[gguf_name(hf_name)] = (data, qtype)
    return blocks


def random_k_blocks(shape: tuple, qtype, rng) -> np.ndarray:
    """Random Q4_K, Q5_K or Q6_K blocks whose weights come out about zero-mean with a std of
    1 / sqrt(columns): random bytes, then the fp16 super-block scales set (d, and dmin as d
    times the mean quant, which centres Q4_K's and Q5_K's d * scale * q - dmin * min)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rows, cols = shape
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d_at, dmin_at, mean_q = {"Q4_K": (0, 2, 7.5), "Q5_K": (0, 2, 15.5), "Q6_K": (size - 2, None, 0)}[qtype.name]

    def set_scales(d: float):
        data[..., d_at:d_at + 2] = np.float16(d).reshape(1).view(np.uint8)
        if dmin_at is not None:
            data[..., dmin_at:dmin_at + 2] = np.float16(d * mean_q).reshape(1).view(np.uint8)

    set_scales(1.0)
    set_scales(1 / (math.sqrt(cols) * dequantize(data.reshape(rows, -1), qtype).std()))
    return data.reshape(rows, -1)


# --- Llama 3 ---------------------------------------------------------------------------------

def train_llama3_ranks(text: str, n_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE ranks (256 bytes + merges) trained on text with Meta's Llama 3 split
    pattern, by tiktoken's own (pure Python) trainer."""
    from tiktoken._educational import bpe_train

    return bpe_train(text, n_ranks, LLAMA3_PATTERN, visualise=None)


LLAMA3_STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")


def llama3_ids(n_ranks: int) -> dict[str, int]:
    return {t: n_ranks + i for i, t in enumerate(llama3_special_tokens())}


def write_llama3_hf_tokenizer(ranks: dict[bytes, int], folder: str, chat_template: str | None = None,
                              extra_stop_ids: tuple[int, ...] = ()):
    """tokenizer.json made from the ranks by transformers' TikTokenConverter (what
    transformers uses for Llama 3), Llama 3's 256 special tokens, and the
    tokenizer_config.json / generation_config.json of an instruct model."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    os.makedirs(folder, exist_ok=True)
    ranks_path = os.path.join(folder, "ranks.tiktoken")
    write_tiktoken_ranks(ranks, ranks_path)
    tokenizer = TikTokenConverter(vocab_file=ranks_path, pattern=LLAMA3_PATTERN,
                                  extra_special_tokens=llama3_special_tokens()).converted()
    os.remove(ranks_path)
    ids = llama3_ids(len(ranks))
    bos = ("<|begin_of_text|>", ids["<|begin_of_text|>"])  # as Meta's tokenizer.json adds it to a text
    tokenizer.post_processor = processors.Sequence([tokenizer.post_processor, processors.TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos])])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": 131072, "clean_up_tokenization_spaces": False}
    if chat_template:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ids["<|begin_of_text|>"],
                   "eos_token_id": [ids[t] for t in LLAMA3_STOPS] + list(extra_stop_ids)}, f, indent=2)


def write_llama3(model, ranks: dict[bytes, int], out: str, layouts: list[str], chat_template: str | None = None) -> dict:
    """A Llama 3 checkpoint in each layout: 'hf' (safetensors, tokenizer.json with the chat
    template) or 'meta:MP' (Meta's params.json, shards with the embedding split over the
    vocabulary, tiktoken tokenizer.model). Returns {layout: folder}."""
    folders = {}
    for layout in layouts:
        folder = os.path.join(out, layout.replace(":", "_mp"))
        if layout == "hf":
            save_hf(model, folder)
            write_llama3_hf_tokenizer(ranks, folder, chat_template)
        else:
            save_meta(model, folder, mp=int(layout.split(":")[1]), llama3=True)
            write_tiktoken_ranks(ranks, os.path.join(folder, "tokenizer.model"))
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
