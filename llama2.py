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
import generate
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
                       "norm_eps", "rope_theta")


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


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


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


def tp_world() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


class Attention(nn.Module):
    """Attention with fused q/k/v projection, KV cache, grouped-query heads and RoPE.
    Sharded by parallelize_llama_attn_block: each rank keeps its own heads."""

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

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device):
        shape = (max_batch_size, self.n_local_kv_heads, max_seq_len, self.head_dim)
        self.cache_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, start_pos, freqs_cis: torch.Tensor, mask: torch.Tensor | None,
                slot: int = 0) -> torch.Tensor:
        """start_pos: an int when every row starts at the same position, else a (batch, seq)
        tensor of each query's position; mask: (batch, 1, seq, kv_len) or None (attend to all);
        row i reads and writes KV-cache row slot + i."""
        bsz, seqlen, _ = x.shape
        n_q, n_kv = self.n_local_heads, self.n_local_kv_heads
        qkv = self.wqkv(x).view(bsz, seqlen, n_q + 2 * n_kv, self.head_dim)
        qk = rotate(qkv[:, :, :n_q + n_kv], freqs_cis)  # query and key heads in one go
        xq, xk, xv = qk[:, :, :n_q], qk[:, :, n_q:], qkv[:, :, n_q + n_kv:]

        cache_k, cache_v = self.cache_k[slot:slot + bsz], self.cache_v[slot:slot + bsz]
        if isinstance(start_pos, int):
            kv_len = start_pos + seqlen
            cache_k[:, :, start_pos:kv_len] = xk.transpose(1, 2)
            cache_v[:, :, start_pos:kv_len] = xv.transpose(1, 2)
        else:
            kv_len = mask.size(-1)
            rows = torch.arange(bsz, device=x.device).unsqueeze(1)
            cache_k[rows, :, start_pos] = xk
            cache_v[rows, :, start_pos] = xv
        keys, values = cache_k[:, :, :kv_len], cache_v[:, :, :kv_len]

        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=self.n_local_heads != self.n_local_kv_heads)
        out = self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        if self.process_group is not None:
            dist.all_reduce(out, group=self.process_group)
        return out


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
            dist.all_reduce(out, group=self.process_group)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, None, None)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, start_pos, freqs_cis: torch.Tensor, mask: torch.Tensor | None,
                slot: int = 0) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask, slot)
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
        self.freqs_cis: torch.Tensor | None = None
        self.compiled_decode = None  # set by compile_decode
        self.tie_weights()

    def tie_weights(self):
        """Share the embedding with the output projection when the checkpoint ties them and
        the output is not split over ranks (a split output loads its own slice of it)."""
        if self.params.tie_word_embeddings and self.output_group is None:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, max_batch_size: int | None = None, max_seq_len: int | None = None):
        """Allocate RoPE tables and KV caches on the weights' device (after loading)."""
        p = self.params
        p.max_batch_size = max_batch_size or p.max_batch_size
        p.max_seq_len = max_seq_len or p.max_seq_len
        weight = self.tok_embeddings.weight
        self.freqs_cis = precompute_freqs_cis(p.head_dim, p.max_seq_len, p.rope_theta).to(weight.device)
        for layer in self.layers:
            layer.attention.setup_cache(p.max_batch_size, p.max_seq_len, weight.dtype, weight.device)

    def compile_decode(self, **options):
        """torch.compile the decode step (calls with one token per row), which removes most of
        the per-operation overhead, and compile it now rather than in the first requests.
        Shapes are dynamic, so that the growing KV length does not recompile: one row, several
        rows at one position, and rows at different positions compile one graph each. Meant for
        one model per process: torch.compile's recompile limit (8) counts every model's graphs."""
        for layer in self.layers:  # only the activations' sizes vary, not the caches'
            torch._dynamo.mark_static(layer.attention.cache_k)
            torch._dynamo.mark_static(layer.attention.cache_v)
        self.compiled_decode = torch.compile(self.run_layers, dynamic=True, **options)
        rows = min(2, self.params.max_batch_size)
        tokens = torch.zeros(rows, 2, dtype=torch.long, device=self.tok_embeddings.weight.device)
        self(tokens, 0)  # a prefill (eager), then one step of each kind; cache rows 0 and 1 get junk
        self(tokens[:1, :1], 2)
        if rows > 1:
            self(tokens[:, :1], 2)
            self(tokens[:, :1], [2, 1])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos, slot: int = 0) -> torch.Tensor:
        """Logits (batch, seq, vocab) for tokens (batch, seq) whose first token sits at
        start_pos: one int for all rows, or a list with each row's own position. Row i
        uses KV-cache row slot + i."""
        bsz, seqlen = tokens.shape
        if self.freqs_cis is None:
            raise RuntimeError("call setup_caches() before forward()")
        dtype = self.tok_embeddings.weight.dtype
        if not isinstance(start_pos, int) and len(set(start_pos)) == 1:
            start_pos = start_pos[0]  # all rows at one position: no mask, slice writes to the cache
        # what compile_decode compiled: decode steps, one token per row from cache row 0 after the
        # prompt (a one-token prompt's prefill, at position 0 or in another row, runs eager)
        compiled = self.compiled_decode if seqlen == 1 and slot == 0 and start_pos != 0 else None
        if isinstance(start_pos, int):
            self._check_positions(slot + bsz, start_pos + seqlen)
            # a copy, not a view: the view's offset in the table would make torch.compile recompile at each position
            freqs_cis = self.freqs_cis[start_pos:start_pos + seqlen].clone()
            mask = None
            if seqlen > 1:
                key_pos = torch.arange(start_pos + seqlen, device=tokens.device)
                mask = self._additive_mask(key_pos <= key_pos[start_pos:].unsqueeze(1), dtype)[None, None]
        else:
            kv_len = max(start_pos) + seqlen
            self._check_positions(slot + bsz, kv_len)
            offsets = torch.arange(seqlen, device=tokens.device)
            start_pos = torch.tensor(start_pos, device=tokens.device).unsqueeze(1) + offsets  # (b, s)
            freqs_cis = self.freqs_cis[start_pos]
            key_pos = torch.arange(kv_len, device=tokens.device)
            mask = self._additive_mask(key_pos <= start_pos.unsqueeze(-1), dtype).unsqueeze(1)
        run = compiled or self.run_layers
        return run(self.tok_embeddings(tokens), start_pos, freqs_cis, mask, slot)

    def run_layers(self, h: torch.Tensor, start_pos, freqs_cis: torch.Tensor, mask: torch.Tensor | None,
                   slot: int) -> torch.Tensor:
        """The layers after the embedding: what compile_decode compiles (its inputs, made in
        forward under inference_mode, always have the same layout, so guards hold)."""
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask, slot)
        logits = self.output(self.norm(h)).float()
        if self.output_group is not None:
            logits = gather_last_dim(logits, self.output_group)
        return logits

    @staticmethod
    def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # made once per forward: attention would otherwise convert a boolean mask in every layer
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))

    def _check_positions(self, rows: int, end: int):
        p = self.params
        if rows > p.max_batch_size or end > p.max_seq_len:
            raise ValueError(f"cache rows {rows} x length {end} exceed the KV cache "
                             f"({p.max_batch_size} x {p.max_seq_len})")


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def parallelize_llama_attn_block(model: Transformer, world_size: int):
    """Shard every block for tensor parallelism, in place (best done on the meta device,
    before loading): wq/wk/wv and w1/w3 column-wise (each rank keeps its heads and its part
    of the FFN width), wo and w2 row-wise with an all-reduce of their outputs. The output
    projection is split over the vocabulary when it divides evenly; the embedding is
    replicated. Each rank ends up with plain local tensors, so a decode step costs two
    all-reduces per layer and one all-gather, with no DTensor dispatch in the loop."""
    rank, ws = tp_world()
    if ws != world_size:
        raise ValueError(f"world_size {world_size} does not match the process group's size {ws}")
    if world_size == 1:
        return
    args = model.params
    for layer in model.layers:
        layer.attention.shard(args, rank, world_size)
        layer.feed_forward.shard(world_size)
    if args.vocab_size % world_size == 0:
        device = model.output.weight.device
        model.output = nn.Linear(args.dim, args.vocab_size // world_size, bias=False, device=device)
        model.output_group = dist.group.WORLD


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

    plan = {"tok_embeddings.weight": [Piece("tok_embeddings.weight", (args.vocab_size, dim))],
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
    return device


def tp_llama(model_args, checkpoint_path, tokenizer_path, world_size, dtype: torch.dtype | None = None,
             max_batch_size: int | None = None, max_seq_len: int | None = None, progress=None):
    """Build a Llama sharded over world_size ranks from a Meta or Hugging Face checkpoint
    folder. Each rank reads only its own slices of the (memory-mapped) checkpoint.
    max_batch_size and max_seq_len, when given, size the KV cache instead of model_args.
    progress, if given, is called as progress(stage, **figures) at each stage of loading."""
    report = progress or (lambda stage, **figures: None)
    device = init_distributed(world_size)
    rank, _ = tp_world()
    report("reading checkpoint", path=checkpoint_path)
    tokenizer = Tokenizer(tokenizer_path)
    reader = checkpoint.open_checkpoint(checkpoint_path)
    args = resolve_model_args(model_args, reader.model_args, tokenizer)
    if args.vocab_size < tokenizer.n_words:
        raise ValueError(f"the tokenizer has {tokenizer.n_words} tokens, the model only {args.vocab_size}")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama_attn_block(model, world_size)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    start = time.perf_counter()
    read = reader.load_into(model, weight_plan(model, rank, world_size),
                            progress=lambda read: report("reading checkpoint", bytes=read))
    report("weights loaded", bytes=read, seconds=round(time.perf_counter() - start, 2),
           dtype=str(dtype).removeprefix("torch."))
    model.eval().requires_grad_(False)
    model.setup_caches(max_batch_size, max_seq_len)
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
