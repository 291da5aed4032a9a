"""Attention over the paged KV cache by gathering: each sequence's blocks are copied out of
the pool and attended with scaled_dot_product_attention (the sdpa backend; flex_attention.py
reads the blocks in place). The runner builds one GatherAttention per forward pass (the
metadata, its tensors made once for every layer); each layer's Attention hands it its
queries, keys and values and its cache (model.py). store and causal serve both backends."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batch import Batch, to_device


@dataclass
class GatherAttention:
    """A forward pass's attention metadata. Decoding rows come first, attended in one
    batched call; then each prefill chunk. A chunk without a mask is a prompt's first
    chunk: causal over its own keys only."""
    slots: torch.Tensor  # where each token's keys and values go: block * block_size + offset
    decode_blocks: torch.Tensor | None  # (n_decode, blocks)
    decode_mask: torch.Tensor | None  # (n_decode, 1, 1, blocks * block_size), additive
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (start, length, blocks, mask)

    @classmethod
    def build(cls, batch: Batch, positions: torch.Tensor, block_size: int, dtype: torch.dtype) -> "GatherAttention":
        """The metadata of batch, with the additive masks made once: each query sees the
        keys at its own position and before."""
        device = positions.device
        decode_blocks = decode_mask = None
        if batch.n_decode:
            # at least two blocks (padding ones masked off): a width of one would be a graph of
            # its own for the compiled decode step (torch.compile specializes sizes of 1)
            width = max(2, *map(len, batch.decode_blocks))
            decode_blocks = to_device([b + [0] * (width - len(b)) for b in batch.decode_blocks], device)
            key_pos = torch.arange(width * block_size, device=device)
            decode_mask = additive_mask(key_pos <= positions[:batch.n_decode, None], dtype)[:, None, None]
        chunks, start = [], batch.n_decode
        for length, blocks, first in batch.chunks:
            mask = None
            if first > 0:  # earlier keys are in the cache: gather them
                key_pos = torch.arange(len(blocks) * block_size, device=device)
                mask = additive_mask(key_pos <= positions[start:start + length, None], dtype)[None, None]
            chunks.append((start, length, to_device(blocks, device), mask))
            start += length
        return cls(to_device(batch.slots, device), decode_blocks, decode_mask, chunks)

    def attend(self, xq, xk, xv, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """Store the new keys and values (tokens, kv heads, head_dim) in the cache, then attend
        with the queries (tokens, heads, head_dim) -> (tokens, heads, head_dim)."""
        store(cache_k, cache_v, self.slots, xk, xv)
        gqa = xq.shape[1] != cache_k.shape[0]
        parts = []
        if self.decode_blocks is not None:
            keys, values = gather(cache_k, cache_v, self.decode_blocks)
            q = xq[:self.decode_blocks.shape[0]].unsqueeze(2)  # (rows, heads, 1, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.decode_mask, enable_gqa=gqa)
            parts.append(out.squeeze(2))
        for start, length, blocks, mask in self.chunks:
            if mask is None:
                parts.append(causal(xq, xk, xv, start, length))
                continue
            q = xq[start:start + length].transpose(0, 1).unsqueeze(0)
            keys, values = gather(cache_k, cache_v, blocks.unsqueeze(0))
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
            parts.append(out[0].transpose(0, 1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def store(cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor):
    """Write the new keys and values (tokens, kv heads, head_dim) into their cache slots."""
    n_kv, head_dim = cache_k.shape[0], cache_k.shape[-1]
    for cache, new in ((cache_k, xk), (cache_v, xv)):
        cache.view(n_kv, -1, head_dim).index_copy_(1, slots, new.transpose(0, 1))


def causal(xq, xk, xv, start: int, length: int) -> torch.Tensor:
    """A prompt's first chunk (tokens start..start+length of the pass), which attends only to
    its own keys: no cache to read."""
    q, k, v = (x[start:start + length].transpose(0, 1).unsqueeze(0) for x in (xq, xk, xv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=xq.shape[1] != xk.shape[1])
    return out[0].transpose(0, 1)


def gather(cache_k: torch.Tensor, cache_v: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of rows of blocks (rows, n): (rows, kv heads, n * block_size, head_dim)."""
    rows, n = blocks.shape
    flat = blocks.reshape(-1)
    out = []
    for cache in (cache_k, cache_v):
        n_kv, head_dim = cache.shape[0], cache.shape[-1]
        kv = cache.index_select(1, flat)  # (kv heads, rows * n, block_size, head_dim)
        out.append(kv.view(n_kv, rows, -1, head_dim).transpose(0, 1))
    return out[0], out[1]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # made once per forward: attention would otherwise convert a boolean mask in every layer
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
