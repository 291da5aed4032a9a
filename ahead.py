"""Asynchronous scheduling (vLLM v1's): a step samples its tokens on the device and leaves
them there, where the next step reads them as inputs; the host appends them (Engine.settle)
after it has queued that next step. This module decides when a step may run ahead and
carries the tokens on their way to the host."""

import itertools

import torch

import collectives
from batch import to_device
from kv_cache import BlockPool
from sampler import adjust_logits, sample
from scheduler import Scheduler
from sequence import Sequence


def runs_ahead(seq: Sequence) -> bool:
    """Whether seq's next token may be sampled before the host has its last one: nothing
    that picks it reads the tokens on the host (penalties, a grammar, min_tokens still to
    reach), and no logprobs are due with it. (Speculation proposes from the host's tokens:
    an engine never runs ahead with it.)"""
    return (seq.params.constraint is None and seq.counts is None
            and not seq.params.logprobs and len(seq.tokens) >= seq.params.min_tokens)


def may_run_ahead(scheduler: Scheduler, pool: BlockPool) -> bool:
    """Whether the next step may start with the last step's tokens still on the device:
    every sequence it may sample for runs ahead (else it samples on the host, after the
    last step's tokens), and every decoding sequence has a block for its next token, so
    that none is preempted (its recomputed tokens would include one the host lacks)."""
    if not all(map(runs_ahead, itertools.chain(scheduler.running, scheduler.waiting))):
        return False
    needed = sum(s.table.blocks_for(s.cached + 1) for s in scheduler.running)
    return needed <= pool.num_free


def sample_ahead(seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> "Ahead":
    """Each sequence's next token (rank 0's on every rank), sampled on the device and left
    there, with its copy to the host started."""
    tokens = sample(adjust_logits(logits[to_device(rows, logits.device, torch.long)], seqs), seqs)
    if collectives.tp_world()[1] > 1:
        collectives.broadcast(tokens, src=0)
    for seq in seqs:
        seq.ahead += 1
    return Ahead(seqs, tokens)


class Ahead:
    """A step's sampled tokens on their way to the host: the sequences that sampled them, the
    tokens on the device (the next step's inputs) and their copy on the host."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor):
        self.seqs, self.tokens = seqs, tokens
        self.index = {seq: i for i, seq in enumerate(seqs)}
        self.ready = None
        self.host = tokens
        if tokens.device.type == "cuda":  # one copy per step, waited for only when settled
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def on_host(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

