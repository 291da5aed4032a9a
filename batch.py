"""One forward pass's work as the engine hands it to the model: which tokens, at which
positions, into which KV-cache slots, and which blocks each sequence attends over."""

from dataclasses import dataclass, field


@dataclass
class Batch:
    """One forward pass over sequences whose keys and values live in the paged KV cache.
    The first n_decode tokens each take one sequence one token further; after them come
    prefill chunks, each a run of consecutive tokens of one sequence. Plain lists: the
    engine builds them, Transformer.forward_batch turns them into tensors."""
    tokens: list[int]
    positions: list[int]
    slots: list[int]  # where each token's keys and values go: block * block_size + offset
    n_decode: int = 0
    decode_blocks: list[list[int]] = field(default_factory=list)  # each decoding sequence's block table
    # (tokens, block table, first position: 0 for a prompt's first chunk, nothing cached) per chunk
    chunks: list[tuple[int, list[int], int]] = field(default_factory=list)
    logits_at: list[int] | None = None  # the tokens whose logits are wanted; None: all

    def add(self, tokens: list[int], start: int, blocks: list[int], block_size: int, decode: bool):
        """One sequence's tokens at positions start..., whose keys and values go in blocks (its
        block table): a decode row (one token; every decode row before the first chunk) or a chunk."""
        end = start + len(tokens)
        self.tokens += tokens
        self.positions += range(start, end)
        self.slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
        used = blocks[:(end - 1) // block_size + 1]
        if decode:
            self.n_decode += 1
            self.decode_blocks.append(used)
        else:
            self.chunks.append((len(tokens), used, start))
