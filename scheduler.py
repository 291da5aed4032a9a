"""Which tokens one engine step computes: the running sequences' next tokens first, then
chunks of prompts, within a token budget; new sequences are admitted while there are
blocks and room, first come first served; a running sequence that needs a block when none
is free takes it from the newest one, which is preempted (its blocks freed, its tokens
recomputed later). Plain Python, no tensors: every tensor-parallel rank makes the same
decisions from the same calls, so the ranks' block tables agree."""

import hashlib
from collections import deque
from dataclasses import dataclass

from kv_cache import BlockPool, BlockTable
from sequence import Sequence


@dataclass
class Work:
    """One step's work for one sequence: its next n tokens into the cache."""
    seq: Sequence
    n: int


class Scheduler:
    def __init__(self, pool: BlockPool, max_seqs: int, max_batched_tokens: int = 0):
        """max_batched_tokens: the tokens one step may compute (0: no limit)."""
        self.pool, self.max_seqs = pool, max_seqs
        self.max_batched_tokens = max_batched_tokens or float("inf")
        self.waiting: deque = deque()  # not yet holding blocks, first come first served
        self.running: list = []  # holding blocks, oldest first
        self.preemptions = 0
        self.digest = hashlib.sha1()  # of every decision, to compare the ranks'

    def add(self, seq):
        seq.table = BlockTable(self.pool)
        seq.cached = 0  # tokens whose keys and values are in the cache
        self.waiting.append(seq)

    def remove(self, seq):
        """A finished or abandoned sequence: free its blocks (full ones stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.table.free()

    @staticmethod
    def uncached(seq) -> int:
        """The sequence's tokens not in the KV cache yet: what it still needs computed (a token
        sampled ahead included: its id reaches the step on the device)."""
        return len(seq.prompt_tokens) + len(seq.tokens) + seq.ahead - seq.cached

    def is_decode(self, w: Work) -> bool:
        """A single token that is the sequence's last: it goes in the batch's decode rows."""
        return w.n == 1 and self.uncached(w.seq) == 1

    def schedule(self) -> list[Work]:
        """This step's work: one token for each decoding sequence, then prefill chunks of the
        sequences already running, then of new ones, while the budget lasts; then room for
        the proposed tokens that decoding sequences may verify (speculative.py), from what
        is left."""
        budget = self.max_batched_tokens
        work = []
        for decoding in (True, False):
            for seq in list(self.running):
                if seq not in self.running or (self.uncached(seq) == 1) != decoding or budget <= 0:
                    continue
                if seq.ahead and seq.ending:  # its last token is on its way: nothing to compute
                    continue
                n = min(self.uncached(seq), budget)
                if self.make_room(seq, seq.cached + n):
                    work.append(Work(seq, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            n = self.admit(self.waiting[0], budget)
            if not n:
                break
            seq = self.waiting.popleft()
            self.running.append(seq)
            work.append(Work(seq, n))
            budget -= n
        work = [w for w in work if w.seq in self.running]  # not those preempted after their turn
        self.room_for_drafts(work, budget)
        work.sort(key=lambda w: not self.is_decode(w))  # stable: oldest first within each kind
        for w in work:
            self.digest.update(repr((w.seq.id, w.seq.cached, w.n, w.seq.table.blocks)).encode())
        return work

    def room_for_drafts(self, work: list[Work], budget):
        """Each decoding sequence's proposed tokens (as many of its draft_room as fit), after
        everything else: from the budget and the blocks that this step leaves free, so that
        tokens that may be rejected never preempt a sequence nor keep one waiting."""
        for w in work:
            room = min(w.seq.draft_room, budget) if self.is_decode(w) else 0
            free = (len(w.seq.table.blocks) + self.pool.num_free) * self.pool.block_size - (w.seq.cached + w.n)
            w.seq.draft_room = max(0, min(room, free))
            w.seq.table.grow(w.seq.cached + w.n + w.seq.draft_room)
            w.n += w.seq.draft_room
            budget -= w.seq.draft_room

    def make_room(self, seq, n_tokens: int) -> bool:
        """Blocks for seq's first n_tokens, preempting the newest other sequences if need be;
        False if seq is the newest itself and was preempted."""
        while not seq.table.grow(n_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq):
        self.running.remove(seq)
        seq.table.free()
        seq.cached = seq.draft_room = seq.draft_cached = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def admit(self, seq, budget: int) -> int:
        """How many tokens of a waiting sequence to compute this step (0: it keeps waiting).
        It starts only if the blocks for all its uncached tokens are free, so that it does
        not preempt running sequences to finish its prompt."""
        tokens = seq.prompt_tokens + seq.tokens
        if self.pool.caching and not seq.needs_prompt_logprobs:
            seq.cached = seq.table.match_prefix(tokens, len(tokens) - 1)  # the last token is always computed
        if seq.table.blocks_for(len(tokens)) > self.pool.num_free:
            seq.table.free()
            seq.cached = 0
            return 0
        seq.table.grow(len(tokens))
        self.pool.queries += len(tokens)
        self.pool.hits += seq.cached
        return min(self.uncached(seq), budget)
