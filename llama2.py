"""The Llama model, its tensor-parallel sharding, and tp_llama, which loads a checkpoint
folder (Meta or Hugging Face layout) straight into each rank's shard."""

import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import checkpoint
import collectives
import generate
import quant
from batch import Batch
from tokenizer import Tokenizer


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1  # -1: taken from the tokenizer or the checkpoint
    multiple_of: int = 256  # Meta's rule rounds the SwiGLU width up to this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    max_batch_size: int = 32
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    intermediate_size: int | None = None  # explicit SwiGLU width (Hugging Face); None: Meta's rule
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None  # Llama 3.1's: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    max_position_embeddings: int | None = None  # the positions the model knows; None: not given

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return meta_ffn_hidden_dim(4 * self.dim, self.multiple_of, self.ffn_dim_multiplier)


ARCHITECTURE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim",
                       "norm_eps", "rope_theta", "rope_scaling")


def meta_ffn_hidden_dim(hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    hidden_dim = int(2 * hidden_dim / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, rope_scaling: dict | None = None) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if rope_scaling is not None:
        freqs = llama3_scaled_freqs(freqs, **rope_scaling)
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def llama3_scaled_freqs(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: wavelengths longer than the original context / low_freq_factor
    are stretched by factor, those shorter than context / high_freq_factor kept, and the
    ones between blended smoothly."""
    context = original_max_position_embeddings
    wavelen = 2 * torch.pi / freqs
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > context / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < context / high_freq_factor, freqs, scaled)


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by Meta's interleaved convention. freqs_cis is
    (seq, head_dim // 2), or (batch, seq, head_dim // 2) when rows sit at different positions."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis.unsqueeze(-2)).flatten(-2).type_as(x)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta's signature: queries and keys rotated alike (see rotate)."""
    return rotate(xq, freqs_cis), rotate(xk, freqs_cis)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand (batch, n_kv_heads, seq, head_dim) to (batch, n_kv_heads * n_rep, seq, head_dim).
    Attention itself lets scaled_dot_product_attention share the heads (enable_gqa), which
    avoids this copy; the function stays for callers of the reference API."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


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


KV_BLOCK_SIZE = 16  # tokens per KV-cache block


@dataclass
class Attend:
    """Batch's attention inputs as tensors, made once per forward pass for every layer.
    A chunk without a mask is a prompt's first chunk: causal over its own keys only."""
    slots: torch.Tensor
    decode_blocks: torch.Tensor | None  # (n_decode, blocks)
    decode_mask: torch.Tensor | None  # (n_decode, 1, 1, blocks * block_size), additive
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (start, length, blocks, mask)


class Attention(nn.Module):
    """Attention with fused q/k/v projection, a paged KV cache, grouped-query heads and
    RoPE. The cache of each layer is a pool of blocks, (kv heads, blocks, block_size,
    head_dim); a sequence's keys are gathered from its blocks for
    scaled_dot_product_attention. Sharded by parallelize_llama_attn_block: each rank keeps
    its own heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_local_heads = args.n_heads
        self.n_local_kv_heads = args.n_kv_heads
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.process_group = None  # set when sharded: wo's partial sums are all-reduced
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None

    def shard(self, args: ModelArgs, rank: int, world_size: int):
        q_heads, kv_heads = head_ranges(args, rank, world_size)
        self.n_local_heads, self.n_local_kv_heads = len(q_heads), len(kv_heads)
        width = (self.n_local_heads + 2 * self.n_local_kv_heads) * self.head_dim
        self.wqkv = nn.Linear(args.dim, width, bias=False, device=self.wqkv.weight.device)
        self.wo = nn.Linear(self.n_local_heads * self.head_dim, args.dim, bias=False, device=self.wo.weight.device)
        self.process_group = dist.group.WORLD

    def setup_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (self.n_local_kv_heads, num_blocks, block_size, self.head_dim)
        self.cache_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x: (1, tokens, dim), freqs_cis: (tokens, head_dim // 2)."""
        n_tokens = x.shape[1]
        n_q, n_kv = self.n_local_heads, self.n_local_kv_heads
        qkv = self.wqkv(x).view(1, n_tokens, n_q + 2 * n_kv, self.head_dim)
        qk = rotate(qkv[:, :, :n_q + n_kv], freqs_cis)[0]  # query and key heads in one go
        xq, xk, xv = qk[:, :n_q], qk[:, n_q:], qkv[0, :, n_q + n_kv:]
        for cache, new in ((self.cache_k, xk), (self.cache_v, xv)):
            cache.view(n_kv, -1, self.head_dim).index_copy_(1, attend.slots, new.transpose(0, 1))
        out = self.wo(self.attend(xq, xk, xv, attend).reshape(1, n_tokens, -1))
        if self.process_group is not None:
            collectives.all_reduce(out, self.process_group)
        return out

    def attend(self, xq, xk, xv, attend: Attend) -> torch.Tensor:
        """(tokens, heads, head_dim): the decoding rows in one batched call, then each chunk."""
        gqa = self.n_local_heads != self.n_local_kv_heads
        parts = []
        if attend.decode_blocks is not None:
            keys, values = self.gather(attend.decode_blocks)
            q = xq[:attend.decode_blocks.shape[0]].unsqueeze(2)  # (rows, heads, 1, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend.decode_mask, enable_gqa=gqa)
            parts.append(out.squeeze(2))
        for start, length, blocks, mask in attend.chunks:
            q = xq[start:start + length].transpose(0, 1).unsqueeze(0)
            if mask is None:
                keys = xk[start:start + length].transpose(0, 1).unsqueeze(0)
                values = xv[start:start + length].transpose(0, 1).unsqueeze(0)
                out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
            else:
                keys, values = self.gather(blocks.unsqueeze(0))
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
            parts.append(out[0].transpose(0, 1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows of blocks (rows, n): (rows, kv heads, n * block_size, head_dim)."""
        rows, n = blocks.shape
        flat = blocks.reshape(-1)
        out = []
        for cache in (self.cache_k, self.cache_v):
            kv = cache.index_select(1, flat)  # (kv heads, rows * n, block_size, head_dim)
            out.append(kv.view(self.n_local_kv_heads, rows, -1, self.head_dim).transpose(0, 1))
        return out[0], out[1]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), with w1 and w3 fused into one projection (w13)."""

    def __init__(self, dim: int, hidden_dim: int, multiple_of: int | None, ffn_dim_multiplier: float | None):
        super().__init__()
        if multiple_of is not None:  # Meta's rule; None takes hidden_dim as the width itself
            hidden_dim = meta_ffn_hidden_dim(hidden_dim, multiple_of, ffn_dim_multiplier)
        self.hidden_dim = hidden_dim
        self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.process_group = None

    def shard(self, world_size: int):
        if self.hidden_dim % world_size:
            raise ValueError(f"FFN width {self.hidden_dim} cannot be split over {world_size} ranks")
        self.hidden_dim //= world_size
        dim, device = self.w2.out_features, self.w2.weight.device
        self.w13 = nn.Linear(dim, 2 * self.hidden_dim, bias=False, device=device)
        self.w2 = nn.Linear(self.hidden_dim, dim, bias=False, device=device)
        self.process_group = dist.group.WORLD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        out = self.w2(F.silu(gate) * up)
        if self.process_group is not None:
            collectives.all_reduce(out, self.process_group)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, None, None)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attend)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        if params.vocab_size <= 0:
            raise ValueError("vocab_size must be set (it is -1 until a tokenizer or checkpoint gives it)")
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.output_group = None  # set when the vocabulary is split: logits are all-gathered
        self.embed_group = None  # likewise: each rank embeds its part of the vocabulary, summed over ranks
        self.embed_start = 0  # the first token id of this rank's part
        self.freqs_cis: torch.Tensor | None = None
        self.compiled_decode = None  # set by compile_decode
        self.decode_buckets: tuple[list[int], list[int]] | None = None  # compile_decode(cuda_graphs=True)
        self.block_size = KV_BLOCK_SIZE
        self.tie_weights()

    def tie_weights(self):
        """Share the embedding with the output projection when the checkpoint ties them (split
        over the ranks, both hold the same part of the vocabulary)."""
        if self.params.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings. Split over the vocabulary, a rank looks up the tokens of its
        part (the others give zeros) and an all-reduce sums the parts."""
        if self.embed_group is None:
            return self.tok_embeddings(tokens)
        local = tokens - self.embed_start
        inside = (local >= 0) & (local < self.tok_embeddings.num_embeddings)
        h = self.tok_embeddings(local.masked_fill(~inside, 0)).masked_fill_(~inside.unsqueeze(-1), 0.0)
        collectives.all_reduce(h, self.embed_group)
        return h

    def setup_caches(self, max_batch_size: int | None = None, max_seq_len: int | None = None,
                     num_blocks: int | None = None):
        """Allocate the RoPE table and the paged KV cache on the weights' device (after
        loading): num_blocks blocks of block_size tokens per layer, by default enough for
        max_batch_size rows of max_seq_len tokens (what forward() addresses as rows)."""
        p = self.params
        p.max_batch_size = max_batch_size or p.max_batch_size
        p.max_seq_len = max_seq_len or p.max_seq_len
        weight = self.tok_embeddings.weight
        if p.max_position_embeddings and p.max_seq_len > p.max_position_embeddings:
            raise ValueError(f"max_seq_len {p.max_seq_len} exceeds the {p.max_position_embeddings} positions "
                             "the model was trained for (max_position_embeddings)")
        self.freqs_cis = precompute_freqs_cis(p.head_dim, p.max_seq_len, p.rope_theta, p.rope_scaling).to(weight.device)
        self.row_blocks = -(-p.max_seq_len // self.block_size)  # blocks of one row of forward()
        self.num_blocks = num_blocks or p.max_batch_size * self.row_blocks
        if self.num_blocks < self.row_blocks:
            raise ValueError(f"a KV cache of {self.num_blocks} blocks of {self.block_size} tokens cannot hold one "
                             f"sequence of max_seq_len {p.max_seq_len}")
        for layer in self.layers:
            layer.attention.setup_cache(self.num_blocks, self.block_size, weight.dtype, weight.device)

    def kv_block_bytes(self) -> int:
        """Bytes of one KV-cache block on this rank, all layers (in the weights' dtype)."""
        attn = self.layers[0].attention
        return (2 * self.n_layers * attn.n_local_kv_heads * self.block_size * attn.head_dim
                * self.tok_embeddings.weight.element_size())

    def compile_decode(self, cuda_graphs: bool = False, **options):
        """torch.compile the decode step (one token for each of several sequences), which
        removes most of the per-operation overhead, and compile it now rather than in the
        first requests. Shapes are dynamic, so that growing block tables do not recompile;
        one row and several rows, one block and several, compile a graph each. Meant for one
        model per process: torch.compile's recompile limit (8) counts every model's graphs.

        cuda_graphs: also replay each decode step from a CUDA graph (mode "reduce-overhead"),
        so that a GPU step costs its weights' bytes rather than hundreds of kernel launches.
        A graph has fixed shapes and addresses: decode steps run padded (bucketed_decode), one
        graph per (rows bucket, blocks bucket), all captured here, and the caches stay where
        they are, with one more block for padding rows to write (they are allocated again
        here: call it before serving). Off CUDA the same padded steps run compiled, without
        graphs (the CPU dry run)."""
        if cuda_graphs:  # the caches again, with a scratch block that the pool never hands out
            self.scratch_block = self.num_blocks
            weight = self.tok_embeddings.weight
            for layer in self.layers:
                layer.attention.setup_cache(self.num_blocks + 1, self.block_size, weight.dtype, weight.device)
            options.setdefault("mode", "reduce-overhead")
        for layer in self.layers:  # only the activations' sizes vary, not the caches'
            for cache in (layer.attention.cache_k, layer.attention.cache_v):
                torch._dynamo.mark_static(cache)
                if cuda_graphs:  # written in place by the graphs: an input copied in would be lost
                    torch._dynamo.mark_static_address(cache)
        self.compiled_decode = torch.compile(self.run_layers, dynamic=True, **options)
        if cuda_graphs:
            self.decode_buckets = (buckets(self.params.max_batch_size, 1), buckets(self.row_blocks, 4))
            nothing = Batch(tokens=[], positions=[], slots=[])
            for width in self.decode_buckets[1]:
                position = min(width * self.block_size, self.params.max_seq_len) - 1
                for rows in self.decode_buckets[0]:  # rows of padding only: the scratch block gets junk
                    for _ in range(3):  # cudagraph trees: a warm-up run, the capture, a replay
                        self.bucketed_decode(nothing, rows, width, position)
            return
        # as many cache rows as the pool holds (a small kv_cache_bytes may give it one)
        rows = min(2, self.params.max_batch_size, self.num_blocks // self.row_blocks)
        length = min(self.block_size + 2, self.params.max_seq_len - 1)
        tokens = torch.zeros(rows, length, dtype=torch.long, device=self.tok_embeddings.weight.device)
        self(tokens, 0)  # a prefill (eager), then decode steps of each kind; rows 0 and 1 get junk
        for pos in (1, length):
            self(tokens[:1, :1], pos)
            if rows > 1:
                self(tokens[:, :1], [pos, pos - 1])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos, slot: int = 0) -> torch.Tensor:
        """Logits (batch, seq, vocab) for tokens (batch, seq) whose first token sits at
        start_pos: one int for all rows, or a list with each row's own position. Row i's
        keys and values live in the blocks of cache row slot + i (the KV cache seen as
        max_batch_size rows of max_seq_len tokens, as in Meta's reference)."""
        bsz, seqlen = tokens.shape
        if self.freqs_cis is None:
            raise RuntimeError("call setup_caches() before forward()")
        starts = [start_pos] * bsz if isinstance(start_pos, int) else list(start_pos)
        end = max(starts) + seqlen
        if (slot + bsz) * self.row_blocks > self.num_blocks or end > self.params.max_seq_len:
            raise ValueError(f"cache rows {slot + bsz} x length {end} exceed the KV cache "
                             f"({self.num_blocks // self.row_blocks} x {self.params.max_seq_len})")
        batch = Batch(tokens=tokens.reshape(-1).tolist(), positions=[], slots=[])
        tables = []
        for row, start in enumerate(starts):
            first = (slot + row) * self.row_blocks
            table = list(range(first, first + -(-(start + seqlen) // self.block_size)))
            positions = range(start, start + seqlen)
            batch.positions += positions
            batch.slots += [table[q // self.block_size] * self.block_size + q % self.block_size for q in positions]
            tables.append(table)
        if seqlen == 1:
            batch.n_decode, batch.decode_blocks = bsz, tables
        else:
            batch.chunks = [(seqlen, table) for table in tables]
        return self.forward_batch(batch).view(bsz, seqlen, -1)

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> torch.Tensor:
        """Logits (len(logits_at), vocab) of one pass over the sequences of batch."""
        if self.decode_buckets is not None and not batch.chunks and batch.n_decode <= self.decode_buckets[0][-1]:
            return self.bucketed_decode(batch)
        device = self.tok_embeddings.weight.device
        logits_at = None if batch.logits_at is None else torch.tensor(batch.logits_at, device=device)
        run = self.compiled_decode if self.compiled_decode is not None and not batch.chunks else self.run_layers
        return run(*self.layer_inputs(batch), logits_at)

    def layer_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Attend]:
        """run_layers' inputs for batch: the embeddings, the rotary table at each position
        (gathered outside the graph: a view's offset would recompile at each position), and
        the attention's tensors."""
        device = self.tok_embeddings.weight.device
        tokens = torch.tensor(batch.tokens, device=device)
        positions = torch.tensor(batch.positions, device=device)
        return self.embed(tokens).unsqueeze(0), self.freqs_cis[positions], self.attend(batch, positions)

    @torch.inference_mode()
    def bucketed_decode(self, batch: Batch, rows: int | None = None, width: int | None = None,
                        padding_position: int = 0):
        """A decode-only batch in the fixed shapes of a CUDA graph: the rows padded up to the
        next rows bucket, each block table padded (block 0, masked off) to the next blocks
        bucket (or to rows and width blocks), logits for every row, logits_at picked
        afterwards. A padding row reads and writes only the scratch block."""
        n, size = batch.n_decode, self.block_size
        rows = rows or next(b for b in self.decode_buckets[0] if b >= n)
        width = width or next(w for w in self.decode_buckets[1] if w >= max(map(len, batch.decode_blocks)))
        pad, scratch = rows - n, self.scratch_block
        tables = [b + [0] * (width - len(b)) for b in batch.decode_blocks] + [[scratch] * width] * pad
        padded = Batch(tokens=batch.tokens + [0] * pad, positions=batch.positions + [padding_position] * pad,
                       slots=batch.slots + [scratch * size] * pad, n_decode=rows, decode_blocks=tables)
        inputs = self.layer_inputs(padded)
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs may be overwritten now
        logits = self.compiled_decode(*inputs, None)
        wanted = torch.tensor(list(range(n) if batch.logits_at is None else batch.logits_at), dtype=torch.long,
                              device=logits.device)
        return logits[wanted]  # a copy: the graph's output buffer is overwritten by its next replay

    def attend(self, batch: Batch, positions: torch.Tensor) -> Attend:
        """The tensors every layer's attention needs, with the additive masks made once:
        each query sees the keys at its own position and before."""
        device, dtype, size = positions.device, self.tok_embeddings.weight.dtype, self.block_size
        decode_blocks = decode_mask = None
        if batch.n_decode:
            width = max(map(len, batch.decode_blocks))
            decode_blocks = torch.tensor([b + [0] * (width - len(b)) for b in batch.decode_blocks], device=device)
            key_pos = torch.arange(width * size, device=device)
            decode_mask = additive_mask(key_pos <= positions[:batch.n_decode, None], dtype)[:, None, None]
        chunks, start = [], batch.n_decode
        for length, blocks in batch.chunks:
            first = batch.positions[start]
            mask = None
            if first > 0:  # earlier keys are in the cache: gather them
                key_pos = torch.arange(len(blocks) * size, device=device)
                mask = additive_mask(key_pos <= positions[start:start + length, None], dtype)[None, None]
            chunks.append((start, length, torch.tensor(blocks, device=device), mask))
            start += length
        return Attend(torch.tensor(batch.slots, device=device), decode_blocks, decode_mask, chunks)

    def run_layers(self, h: torch.Tensor, freqs_cis: torch.Tensor, attend: Attend,
                   logits_at: torch.Tensor | None) -> torch.Tensor:
        """The layers after the embedding, and the logits of the tokens logits_at names:
        what compile_decode compiles."""
        for layer in self.layers:
            h = layer(h, freqs_cis, attend)
        h = h[0] if logits_at is None else h[0, logits_at]
        logits = self.output(self.norm(h)).float()
        if self.output_group is not None:
            logits = collectives.all_gather_last_dim(logits, self.output_group)
        return logits


def buckets(limit: int, first: int) -> list[int]:
    """Powers of two from first up to limit, and limit itself: the sizes graphs are captured for."""
    sizes = [first]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    return [n for n in sizes if n < limit] + [limit]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # made once per forward: attention would otherwise convert a boolean mask in every layer
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def parallelize_llama_attn_block(model: Transformer, world_size: int):
    """Shard every block for tensor parallelism, in place (best done on the meta device,
    before loading): wq/wk/wv and w1/w3 column-wise (each rank keeps its heads and its part
    of the FFN width), wo and w2 row-wise with an all-reduce of their outputs. The embedding
    and the output projection are split over the vocabulary when it divides evenly (else
    replicated), as vLLM's VocabParallelEmbedding and ParallelLMHead. Each rank ends up with
    plain local tensors, so a forward pass costs an all-reduce for the embedding, two per
    layer and an all-gather of the logits, with no DTensor dispatch in the loop."""
    rank, ws = collectives.tp_world()
    if ws != world_size:
        raise ValueError(f"world_size {world_size} does not match the process group's size {ws}")
    if world_size == 1:
        return
    args = model.params
    for layer in model.layers:
        layer.attention.shard(args, rank, world_size)
        layer.feed_forward.shard(world_size)
    if args.vocab_size % world_size == 0:
        device, part = model.output.weight.device, args.vocab_size // world_size
        model.output = nn.Linear(args.dim, part, bias=False, device=device)
        model.tok_embeddings = nn.Embedding(part, args.dim, device=device)
        model.output_group = model.embed_group = dist.group.WORLD
        model.embed_start = rank * part
        model.tie_weights()


def weight_plan(model: Transformer, rank: int, world_size: int) -> dict[str, list[checkpoint.Piece]]:
    """For each parameter of this rank's model, the checkpoint slices (by Meta names) that
    fill it, stacked along dim 0: this is where the stacked projections are mapped."""
    args = model.params
    hd, dim, hidden = args.head_dim, args.dim, args.ffn_hidden_dim
    q_heads, kv_heads = head_ranges(args, rank, world_size)
    q_rows = (q_heads.start * hd, q_heads.stop * hd)
    kv_rows = (kv_heads.start * hd, kv_heads.stop * hd)
    ffn_part = hidden // world_size
    ffn_rows = (rank * ffn_part, (rank + 1) * ffn_part)
    Piece = checkpoint.Piece

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


def resolve_model_args(model_args: ModelArgs | None, checkpoint_args: dict, tokenizer: Tokenizer) -> ModelArgs:
    """The checkpoint's architecture, checked against model_args when given; model_args
    (or the checkpoint) sizes the KV cache."""
    ckpt = ModelArgs(**checkpoint_args)
    if ckpt.vocab_size <= 0:
        ckpt.vocab_size = tokenizer.n_words
    if model_args is None:
        return ckpt
    given = dataclasses.replace(model_args)
    if given.vocab_size <= 0:
        given.vocab_size = ckpt.vocab_size
    wrong = [f"{f}: given {getattr(given, f)}, checkpoint has {getattr(ckpt, f)}"
             for f in ARCHITECTURE_FIELDS if getattr(given, f) != getattr(ckpt, f)]
    if wrong:
        raise ValueError("model_args disagree with the checkpoint: " + "; ".join(wrong))
    return dataclasses.replace(ckpt, max_batch_size=given.max_batch_size, max_seq_len=given.max_seq_len)


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


def tp_llama(model_args, checkpoint_path, tokenizer_path, world_size, dtype: torch.dtype | None = None,
             max_batch_size: int | None = None, max_seq_len: int | None = None, kv_cache_bytes: int = 0,
             progress=None, quantization: str | None = None):
    """Build a Llama sharded over world_size ranks from a Meta or Hugging Face checkpoint
    folder. Each rank reads only its own slices of the (memory-mapped) checkpoint.
    max_batch_size and max_seq_len, when given, size the KV cache instead of model_args;
    kv_cache_bytes, when given, is the KV cache's size on each rank instead. progress, if
    given, is called as progress(stage, **figures) at each stage of loading. quantization:
    None, "int8" or "int4" (quant.py): each rank quantizes its shard as it loads it."""
    report = progress or (lambda stage, **figures: None)
    device = init_distributed(world_size)
    rank, _ = collectives.tp_world()
    report("reading checkpoint", path=checkpoint_path)
    tokenizer = Tokenizer(tokenizer_path or checkpoint_path)  # a file, or a folder that holds one
    reader = checkpoint.open_checkpoint(checkpoint_path)
    args = resolve_model_args(model_args, reader.model_args, tokenizer)
    if max_seq_len is None and model_args is None and args.max_position_embeddings:
        args.max_seq_len = min(args.max_seq_len, args.max_position_embeddings)  # the default, capped
    if args.vocab_size < tokenizer.n_words:
        raise ValueError(f"the tokenizer has {tokenizer.n_words} tokens, the model only {args.vocab_size}")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama_attn_block(model, world_size)
    model = model.to(dtype)
    start = time.perf_counter()
    plan = weight_plan(model, rank, world_size)

    def on_read(read: int):
        report("reading checkpoint", bytes=read)

    if quantization:
        read = quant.load_quantized(model, reader, plan, device, quantization, progress=on_read)
    else:
        model = model.to_empty(device=device)
        model.tie_weights()
        read = reader.load_into(model, plan, progress=on_read)
    quantized = {"quantization": quantization} if quantization else {}
    report("weights loaded", bytes=read, seconds=round(time.perf_counter() - start, 2), **quantized,
           dtype=str(dtype).removeprefix("torch."))
    model.eval().requires_grad_(False)
    model.setup_caches(max_batch_size, max_seq_len, kv_cache_bytes // model.kv_block_bytes() or None)
    report("kv cache allocated", bytes=sum(2 * layer.attention.cache_k.nbytes for layer in model.layers))
    return Llama(model, tokenizer)


class Llama:
    """A model and its tokenizer; text_completion and chat_completion hand over to generate.py."""

    def __init__(self, model: Transformer, tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    def text_completion(self, prompts: list[str], max_gen_len: int | None = None, **options) -> list[generate.CompletionPrediction]:
        return generate.text_completion(self.model, self.tokenizer, prompts, max_gen_len, **options)

    def chat_completion(self, dialogs: list[generate.Dialog], max_gen_len: int | None = None, **options) -> list[generate.ChatPrediction]:
        return generate.chat_completion(self.model, self.tokenizer, dialogs, max_gen_len, **options)
