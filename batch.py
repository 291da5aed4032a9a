"""One forward pass's work as the engine hands it to the model: which tokens, at which
positions, into which KV-cache slots, and which blocks each sequence attends over."""

from dataclasses import dataclass, field

import torch


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
    # asynchronous scheduling: tokens sampled by the step before, still on the device, as
    # (row in tokens, whose entry there is a placeholder; index in carried_from)
    carried: list[tuple[int, int]] = field(default_factory=list)
    carried_from: torch.Tensor | None = None

    def carry(self, index: int, sampled: torch.Tensor):
        """The last token added is sampled[index], which the host does not have yet."""
        assert self.carried_from is None or self.carried_from is sampled
        self.carried.append((len(self.tokens) - 1, index))
        self.carried_from = sampled

    def token_ids(self, device: torch.device) -> torch.Tensor:
        """tokens on device, the carried ones taken from the step before's samples there."""
        tokens = to_device(self.tokens, device)
        if self.carried:
            rows, index = zip(*self.carried)
            tokens[to_device(rows, device)] = self.carried_from[to_device(index, device)]
        return tokens

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


def to_device(values: list | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """values (a list, or a tensor on the CPU) as a tensor on device. On CUDA through pinned
    memory, without waiting: a copy from pageable memory waits for the work queued on the
    stream, and asynchronous scheduling builds a step's inputs while the step before runs."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
