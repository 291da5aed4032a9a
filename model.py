"""The Llama network: Transformer.forward(tokens, positions, attention metadata) -> logits.
Nothing else lives here: tp.py shards the modules for tensor parallelism from outside,
runner.py owns the KV cache (attached to each Attention as cache_k / cache_v), builds the
attention metadata and compiles, and checkpoint.py fills the weights."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import collectives


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


# Meta's constants for Llama 3.1's RoPE scaling (llama-models' apply_scaling: use_scaled_rope);
# Llama 3.2 1B/3B were trained with factor 32.
META_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}


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


class Attention(nn.Module):
    """Attention with fused q/k/v projection, grouped-query heads and RoPE. Keys and values
    go to the paged KV cache that the runner attaches (cache_k, cache_v: (kv heads, blocks,
    block_size, head_dim)); the attention metadata of the forward pass stores them there and
    attends (attention.py). Sharded by tp.py: each rank keeps its own heads."""

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

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_meta) -> torch.Tensor:
        """x: (1, tokens, dim), freqs_cis: (tokens, head_dim // 2)."""
        n_tokens = x.shape[1]
        n_q, n_kv = self.n_local_heads, self.n_local_kv_heads
        qkv = self.wqkv(x).view(1, n_tokens, n_q + 2 * n_kv, self.head_dim)
        qk = rotate(qkv[:, :, :n_q + n_kv], freqs_cis)[0]  # query and key heads in one go
        xq, xk, xv = qk[:, :n_q], qk[:, n_q:], qkv[0, :, n_q + n_kv:]
        out = attn_meta.attend(xq, xk, xv, self.cache_k, self.cache_v)
        out = self.wo(out.reshape(1, n_tokens, -1))
        if self.process_group is not None:
            collectives.all_reduce(out, self.process_group)
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
        self.process_group = None  # set when sharded: w2's partial sums are all-reduced

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

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_meta) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attn_meta)
        return h + self.feed_forward(self.ffn_norm(h))


def to_empty(module: nn.Module, device, recurse: bool = True) -> nn.Module:
    """module.to_empty(device=device): its meta tensors allocated on device, not filled.
    torch's own runs empty_like's Python reference on each meta tensor, whose first call
    imports torch.fx.experimental.symbolic_shapes: 0.3 s of CPU at every worker's start,
    where nothing else a worker that does not compile runs imports it."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=recurse)


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
        self.register_buffer("freqs_cis", None, persistent=False)  # setup_rope
        self.tie_weights()

    def tie_weights(self):
        """Share the embedding with the output projection when the checkpoint ties them (split
        over the ranks, both hold the same part of the vocabulary). A quantized output
        projection (quant.py) is a copy of the embedding in its own format: left as it is."""
        if self.params.tie_word_embeddings and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight

    def setup_rope(self, n_positions: int):
        """The rotary table for positions 0 to n_positions - 1, on the weights' device (after
        loading). A buffer: compiled graphs take it as a static input, not one to copy in."""
        p = self.params
        table = precompute_freqs_cis(p.head_dim, n_positions, p.rope_theta, p.rope_scaling)
        self.freqs_cis = table.to(self.tok_embeddings.weight.device)

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

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_meta,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (len(logits_at), vocab) of one pass over tokens (n,) at positions (n,): of
        every token when logits_at is None. attn_meta stores each layer's keys and values
        in the KV cache and attends (runner.py builds it)."""
        h = self.embed(tokens).unsqueeze(0)
        freqs_cis = self.freqs_cis[positions]
        for layer in self.layers:
            h = layer(h, freqs_cis, attn_meta)
        h = h[0] if logits_at is None else h[0, logits_at]
        logits = self.output(self.norm(h)).float()
        if self.output_group is not None:
            logits = collectives.all_gather_last_dim(logits, self.output_group)
        return logits
