"""The KV cache's bookkeeping: a pool of fixed-size blocks, each sequence's block table,
and automatic prefix caching (as vLLM does it): a full block is known by a hash of its
parent block's hash and its token ids; blocks that nobody holds stay cached until the
least recently used one is needed. Plain Python, no tensors: every tensor-parallel rank
makes the same decisions from the same calls."""

import hashlib
from array import array
from collections import OrderedDict


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash that names a full block: its tokens and, through the parent's hash, every
    token before them."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    """num_blocks blocks of block_size tokens. A block is held (ref > 0), or free: free
    blocks wait in `free`, least recently used first, and those with a hash can still be
    found by it until they are reused."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.queries = self.hits = 0  # prompt tokens looked up, and found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def take(self) -> int:
        """A free block for new tokens: the least recently used one, which forgets its hash."""
        block, _ = self.free.popitem(last=False)
        if self.hash[block] is not None:
            del self.cached[self.hash[block]]
            self.hash[block] = None
        self.ref[block] = 1
        return block

    def hold(self, block: int):
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, block: int):
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None
            if self.hash[block] is None:  # nothing to find it by: reuse it first
                self.free.move_to_end(block, last=False)

    def register(self, block: int, h: bytes):
        """block now holds the full block named h (unless another block does already)."""
        if self.caching and h not in self.cached:
            self.cached[h] = block
            self.hash[block] = h

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h) if self.caching else None


class BlockTable:
    """The blocks that hold one sequence's keys and values, in order, and the hashes of
    its full blocks."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []

    def blocks_for(self, n_tokens: int) -> int:
        """How many more blocks n_tokens cached tokens need."""
        return max(0, -(-n_tokens // self.pool.block_size) - len(self.blocks))

    def match_prefix(self, tokens: list[int], max_tokens: int) -> int:
        """Take the cached full blocks that the sequence's first max_tokens tokens start
        with; returns how many tokens they hold."""
        assert not self.blocks
        size, parent = self.pool.block_size, b""
        for i in range(max_tokens // size):
            h = block_hash(parent, tokens[i * size:(i + 1) * size])
            block = self.pool.lookup(h)
            if block is None:
                break
            self.pool.hold(block)
            self.blocks.append(block)
            self.hashes.append(h)
            parent = h
        return len(self.blocks) * size

    def grow(self, n_tokens: int) -> bool:
        """Room for n_tokens tokens in all; False (and nothing taken) if the pool lacks blocks."""
        need = self.blocks_for(n_tokens)
        if need > self.pool.num_free:
            return False
        self.blocks += [self.pool.take() for _ in range(need)]
        return True

    def trim(self, n_tokens: int):
        """Give back the blocks past those that n_tokens tokens fill (proposed tokens that
        were rejected: no hash names those blocks)."""
        keep = -(-n_tokens // self.pool.block_size)
        for block in reversed(self.blocks[keep:]):
            self.pool.release(block)
        del self.blocks[keep:]

    def commit(self, tokens: list[int], n_cached: int):
        """The first n_cached of tokens are in the cache now: name the blocks they fill."""
        size = self.pool.block_size
        for i in range(len(self.hashes), n_cached // size):
            h = block_hash(self.hashes[-1] if self.hashes else b"", tokens[i * size:(i + 1) * size])
            self.hashes.append(h)
            self.pool.register(self.blocks[i], h)

    def free(self):
        """Give the blocks back, the last first: a prefix's tail is evicted before its head."""
        for block in reversed(self.blocks):
            self.pool.release(block)
        self.blocks, self.hashes = [], []
