"""Attention that reads the paged KV cache in place, with FlexAttention. A layer's pool of
blocks is one long key sequence (kv heads, blocks * block_size, head_dim); a block mask made
from the block tables tells each query which blocks to read whole and which one to read
masked (where its own position falls), so no sequence's keys are copied out, where
GatherAttention copies them every layer (BENCHMARKS.md, attention backends)."""

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from attention import causal, store
from batch import Batch, to_device

CHUNK_QUERY_BLOCK = 128  # a prefill chunk's queries share a block mask row per this many


@functools.cache
def compiled_flex():
    """flex_attention compiled: eager, it is a dense reference that scores the whole pool.
    Inside a compiled model it is traced with the rest. Made at first use: torch.compile took
    0.7 s of every process that imported this module (a rank, make serve's check), flex or not."""
    floats_as_constants()
    return torch.compile(flex_attention, dynamic=True)


def floats_as_constants():
    """The Python floats that compiled graphs read (flex's scale, the norms' eps) are constants
    of the graph. As dynamic inputs (what dynamic=True makes of them), dynamo traced each frame
    twice, restarting to specialise them: compile_decode took 5.0 s of CPU with its graphs in
    inductor's cache, against 3.4-3.7 s."""
    torch._dynamo.config.specialize_float = True


@dataclass
class FlexAttention:
    """A forward pass's attention metadata: one block mask over every decoding row (each a
    query block of its own), then each prefill chunk's (None for a prompt's first chunk,
    which attends to its own keys only)."""
    slots: torch.Tensor  # where each token's keys and values go: block * block_size + offset
    n_decode: int
    decode_mask: BlockMask | None
    chunks: list[tuple[int, int, BlockMask | None]]  # (start, length, mask)
    warm: bool = False  # decode rows before compiled_flex has a graph, on the CPU (warm_decode)

    @classmethod
    def build(cls, batch: Batch, positions: torch.Tensor, block_size: int, pool_blocks: int) -> "FlexAttention":
        """The metadata of batch over a pool of pool_blocks blocks per layer."""
        decode_mask = None
        if batch.n_decode:
            # each table up to its row's position (the runner pads tables for CUDA graphs), and
            # the rows' positions a tensor of their own: a captured view fails to compile on CPU
            tables = [t[:p // block_size + 1] for t, p in zip(batch.decode_blocks, batch.positions)]
            decode_mask = decode_block_mask(tables, positions[:batch.n_decode].clone(), block_size, pool_blocks)
        chunks, start = [], batch.n_decode
        for length, blocks, first in batch.chunks:
            mask = None
            if first > 0:
                mask = chunk_block_mask(blocks, first, length, block_size, pool_blocks, positions.device)
            chunks.append((start, length, mask))
            start += length
        warm = bool(batch.n_decode) and positions.device.type == "cpu" and not has_graph()
        return cls(to_device(batch.slots, positions.device), batch.n_decode, decode_mask, chunks, warm)

    def attend(self, xq, xk, xv, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """Store the new keys and values (tokens, kv heads, head_dim) in the cache, then attend
        with the queries (tokens, heads, head_dim) -> (tokens, heads, head_dim)."""
        store(cache_k, cache_v, self.slots, xk, xv)
        n_kv, head_dim = cache_k.shape[0], cache_k.shape[-1]
        keys, values = (cache.view(1, n_kv, -1, head_dim) for cache in (cache_k, cache_v))
        if not torch.compiler.is_compiling() and self.warm and not has_graph():  # traced: never read
            warm_decode(xq, keys, values, cache_k.shape[2])
        parts = [flex(xq[:self.n_decode], keys, values, self.decode_mask)] if self.n_decode else []
        for start, length, mask in self.chunks:
            parts.append(causal(xq, xk, xv, start, length) if mask is None
                         else flex(xq[start:start + length], keys, values, mask))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def flex(xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """Queries (tokens, heads, head_dim) over the pool's keys and values (1, kv heads, slots,
    head_dim) through mask -> (tokens, heads, head_dim)."""
    # scaled here, so that q is a buffer of its own: compiled on CPU, flex cannot take a view
    # of the rotated heads (a copy is elided)
    q = xq.transpose(0, 1).unsqueeze(0) * xq.shape[-1] ** -0.5
    gqa = xq.shape[1] != keys.shape[1]
    attend = flex_attention if torch.compiler.is_compiling() else compiled_flex()  # traced: with the model
    return attend(q, keys, values, block_mask=mask, scale=1.0, enable_gqa=gqa)[0].transpose(0, 1)


def warm_decode(xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_size: int):
    """Before compiled_flex's first graph: compile it for one decode row, then two. Compiled
    first for some other counts (16 or 64 rows), inductor's CPU template generates C++ that
    does not compile (torch 2.13); the dynamic graph that two rows compile serves every count."""
    pool_blocks = keys.shape[2] // block_size
    for rows in (1, 2):
        positions = torch.zeros(rows, dtype=torch.long, device=keys.device)
        flex(torch.zeros_like(xq[:1]).expand(rows, -1, -1).contiguous(), keys, values,
             decode_block_mask([[0]] * rows, positions, block_size, pool_blocks))


def has_graph() -> bool:
    """Whether compiled_flex has compiled a graph of its own (not traced into a model's)."""
    return bool(torch._dynamo.eval_frame._debug_get_cache_entry_list(flex_attention.__code__))


def decode_block_mask(tables: list[list[int]], positions: torch.Tensor, block_size: int,
                      pool_blocks: int) -> BlockMask:
    """Decoding rows as the query blocks of one sequence of queries: row i reads the blocks of
    tables[i] before its last whole, and its last (which holds its own position) up to that
    position."""
    device, rows = positions.device, len(tables)
    table = blocks_tensor(tables, pool_blocks, device)
    whole = to_device([len(t) - 1 for t in tables], device, torch.int32)
    last = blocks_tensor([t[-1:] for t in tables], pool_blocks, device)
    return BlockMask.from_kv_blocks(
        torch.ones(1, 1, rows, dtype=torch.int32, device=device), last[None, None],
        whole[None, None], table[None, None],
        BLOCK_SIZE=(1, block_size), mask_mod=in_sequence_up_to(logical_blocks(tables, pool_blocks, device),
                                                               positions, block_size),
        seq_lengths=(rows, pool_blocks * block_size), compute_q_blocks=False)


def chunk_block_mask(blocks: list[int], first: int, length: int, block_size: int, pool_blocks: int,
                     device: torch.device) -> BlockMask:
    """A prefill chunk's queries at positions first.. over the sequence's blocks (its block
    table): each query block reads whole the blocks before its first query, masked the ones
    its queries fall in."""
    n_query_blocks = -(-length // CHUNK_QUERY_BLOCK)
    whole, partial = [], []
    for i in range(n_query_blocks):
        lo = first + i * CHUNK_QUERY_BLOCK
        hi = min(lo + CHUNK_QUERY_BLOCK, first + length) - 1
        whole.append((lo + 1) // block_size)
        partial.append(blocks[whole[-1]:hi // block_size + 1])
    mask_mod = in_sequence_up_to(logical_blocks([blocks], pool_blocks, device), to_device([first], device),
                                 block_size)
    return BlockMask.from_kv_blocks(
        to_device([[list(map(len, partial))]], device, torch.int32),
        blocks_tensor(partial, pool_blocks, device)[None, None],
        to_device([[whole]], device, torch.int32),
        blocks_tensor([blocks] * n_query_blocks, pool_blocks, device)[None, None],
        BLOCK_SIZE=(CHUNK_QUERY_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(length, pool_blocks * block_size), compute_q_blocks=False)


def in_sequence_up_to(logical: torch.Tensor, positions: torch.Tensor, block_size: int):
    """The mask of queries over the pool: a query sees a slot if the slot's block is in its
    sequence (logical[row, block]: the block's place there, or -1) at a position up to its
    own. positions: each query's (decoding rows, each with a logical row of its own), or one
    element, the first query's (a prefill chunk: consecutive queries of one sequence). Exact
    for every slot, not only in the blocks that the block mask lists: eager flex_attention
    (the reference) evaluates it everywhere."""
    def seen(place, position, kv):
        return (place >= 0) & (place * block_size + kv % block_size <= position)

    if len(positions) == 1 and logical.shape[0] == 1:
        return lambda b, h, q, kv: seen(logical[0, kv // block_size], q + positions[0], kv)
    return lambda b, h, q, kv: seen(logical[q, kv // block_size], positions[q], kv)


def logical_blocks(tables: list[list[int]], pool_blocks: int, device) -> torch.Tensor:
    """(len(tables), pool_blocks + 1) int32: each block's place in each table, -1 where absent."""
    index = blocks_tensor(tables, pool_blocks, device, pad=pool_blocks).long()  # padding goes past the pool
    places = torch.arange(index.shape[1], dtype=torch.int32, device=device).expand_as(index)
    logical = torch.full((len(tables), pool_blocks + 1), -1, dtype=torch.int32, device=device)
    logical.scatter_(1, index, places)  # its last column takes the padding: never read
    torch._dynamo.mark_static(logical, 1)  # a captured size that varies with the keys' fails to compile on CPU
    return logical


def blocks_tensor(rows: list[list[int]], width: int, device, pad: int = 0) -> torch.Tensor:
    """(len(rows), width) int32: each row's blocks, then pad (a block mask's index rows span
    the whole pool; entries past a row's count are not read)."""
    out = torch.full((len(rows), width), pad, dtype=torch.int32)
    longest = max(map(len, rows))
    if longest:
        out[:, :longest] = torch.tensor([r + [pad] * (longest - len(r)) for r in rows], dtype=torch.int32)
    return to_device(out, device)
