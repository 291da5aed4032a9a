"""Tensor parallelism applied to the network from outside it (as gpt-fast's tp.py): which
heads and rows each rank holds, the sharding of the modules (best done on the meta device,
before loading), and the weight plan that fills each rank's shard from the checkpoint."""

import os

import torch
import torch.distributed as dist
from torch import nn

import collectives
from model import Attention, FeedForward, ModelArgs, Transformer
from weight_plan import Piece


def init_distributed(world_size: int) -> torch.device:
    """Join (or create, under torchrun) the default process group and pick this rank's
    device: one GPU per LOCAL_RANK with NCCL, or CPU with gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
        collectives.setup()
    return device


def head_ranges(args: ModelArgs, rank: int, world_size: int) -> tuple[range, range]:
    """The query heads and key/value heads that one rank holds. With fewer KV heads than
    ranks, each KV head is replicated on the ranks whose query heads use it (as vLLM does)."""
    if args.n_heads % world_size:
        raise ValueError(f"n_heads {args.n_heads} cannot be split over {world_size} ranks")
    n_kv = args.n_kv_heads
    if n_kv >= world_size:
        if n_kv % world_size:
            raise ValueError(f"n_kv_heads {n_kv} cannot be split over {world_size} ranks")
        kv_per_rank = n_kv // world_size
        kv = range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    else:
        if world_size % n_kv:
            raise ValueError(f"{world_size} ranks cannot share {n_kv} KV heads evenly")
        kv_head = rank // (world_size // n_kv)
        kv = range(kv_head, kv_head + 1)
    q_per_rank = args.n_heads // world_size
    return range(rank * q_per_rank, (rank + 1) * q_per_rank), kv


def shard_attention(attn: Attention, args: ModelArgs, rank: int, world_size: int):
    """Keep this rank's query and key/value heads: wqkv column-wise, wo row-wise (its
    partial sums all-reduced)."""
    q_heads, kv_heads = head_ranges(args, rank, world_size)
    attn.n_local_heads, attn.n_local_kv_heads = len(q_heads), len(kv_heads)
    width = (attn.n_local_heads + 2 * attn.n_local_kv_heads) * attn.head_dim
    device = attn.wqkv.weight.device
    attn.wqkv = nn.Linear(args.dim, width, bias=False, device=device)
    attn.wo = nn.Linear(attn.n_local_heads * attn.head_dim, args.dim, bias=False, device=device)
    attn.process_group = dist.group.WORLD


def shard_feed_forward(ffn: FeedForward, world_size: int):
    """Keep this rank's part of the FFN width: w13 column-wise, w2 row-wise (all-reduced)."""
    if ffn.hidden_dim % world_size:
        raise ValueError(f"FFN width {ffn.hidden_dim} cannot be split over {world_size} ranks")
    ffn.hidden_dim //= world_size
    dim, device = ffn.w2.out_features, ffn.w2.weight.device
    ffn.w13 = nn.Linear(dim, 2 * ffn.hidden_dim, bias=False, device=device)
    ffn.w2 = nn.Linear(ffn.hidden_dim, dim, bias=False, device=device)
    ffn.process_group = dist.group.WORLD


def parallelize_llama_attn_block(model: Transformer, world_size: int):
    """Shard the model for tensor parallelism, in place (the seed's name: it shards more than
    attention). Every block's attention and FFN (shard_attention, shard_feed_forward); the
    embedding and the output projection split over the vocabulary when it divides evenly
    (else replicated), as vLLM's VocabParallelEmbedding and ParallelLMHead. Each rank ends up
    with plain local tensors, so a forward pass costs an all-reduce for the embedding, two
    per layer and an all-gather of the logits, with no DTensor dispatch in the loop."""
    rank, ws = collectives.tp_world()
    if ws != world_size:
        raise ValueError(f"world_size {world_size} does not match the process group's size {ws}")
    if world_size == 1:
        return
    args = model.params
    for layer in model.layers:
        shard_attention(layer.attention, args, rank, world_size)
        shard_feed_forward(layer.feed_forward, world_size)
    if args.vocab_size % world_size == 0:
        device, part = model.output.weight.device, args.vocab_size // world_size
        model.output = nn.Linear(args.dim, part, bias=False, device=device)
        model.tok_embeddings = nn.Embedding(part, args.dim, device=device)
        model.output_group = model.embed_group = dist.group.WORLD
        model.embed_start = rank * part
        model.tie_weights()


def weight_plan(model: Transformer, rank: int, world_size: int) -> dict[str, list[Piece]]:
    """For each parameter of this rank's model, the checkpoint slices (by Meta names) that
    fill it, stacked along dim 0: this is where the stacked projections are mapped."""
    args = model.params
    hd, dim, hidden = args.head_dim, args.dim, args.ffn_hidden_dim
    q_heads, kv_heads = head_ranges(args, rank, world_size)
    q_rows = (q_heads.start * hd, q_heads.stop * hd)
    kv_rows = (kv_heads.start * hd, kv_heads.stop * hd)
    ffn_part = hidden // world_size
    ffn_rows = (rank * ffn_part, (rank + 1) * ffn_part)

    rows = model.tok_embeddings.num_embeddings  # the rank's part of the vocabulary, or all of it
    start = model.embed_start
    plan = {"tok_embeddings.weight": [Piece("tok_embeddings.weight", (args.vocab_size, dim), 0, start, start + rows)],
            "norm.weight": [Piece("norm.weight", (dim,))]}
    out_rows = model.output.weight.shape[0]
    out_start = rank * out_rows if model.output_group is not None else 0  # split, or replicated
    plan["output.weight"] = [Piece("output.weight", (args.vocab_size, dim), 0, out_start, out_start + out_rows)]
    for i in range(args.n_layers):
        p = f"layers.{i}."
        kv_shape = (args.n_kv_heads * hd, dim)
        plan[p + "attention.wqkv.weight"] = [
            Piece(p + "attention.wq.weight", (args.n_heads * hd, dim), 0, *q_rows),
            Piece(p + "attention.wk.weight", kv_shape, 0, *kv_rows),
            Piece(p + "attention.wv.weight", kv_shape, 0, *kv_rows)]
        plan[p + "attention.wo.weight"] = [Piece(p + "attention.wo.weight", (dim, args.n_heads * hd), 1, *q_rows)]
        plan[p + "feed_forward.w13.weight"] = [
            Piece(p + "feed_forward.w1.weight", (hidden, dim), 0, *ffn_rows),
            Piece(p + "feed_forward.w3.weight", (hidden, dim), 0, *ffn_rows)]
        plan[p + "feed_forward.w2.weight"] = [Piece(p + "feed_forward.w2.weight", (dim, hidden), 1, *ffn_rows)]
        plan[p + "attention_norm.weight"] = [Piece(p + "attention_norm.weight", (dim,))]
        plan[p + "ffn_norm.weight"] = [Piece(p + "ffn_norm.weight", (dim,))]
    if model.output.weight is model.tok_embeddings.weight:
        del plan["output.weight"]  # tied: the same tensor
    return plan
