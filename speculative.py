"""Speculative decoding's proposers: tokens that a decoding sequence probably continues with,
which the engine verifies in one forward pass (a step that scores k + 1 tokens reads the
weights once, as a step that makes one does) and keeps as far as the model agrees
(Engine.advance: exact for greedy, the same distribution and seeded draws for sampling).

- NgramProposer (prompt lookup): the longest recent n-gram of the sequence's tokens that
  occurred earlier in them proposes the tokens that followed it; no weights.
- DraftProposer: a smaller model with the same tokenizer decodes k tokens ahead, greedily,
  with a KV cache of its own addressed by the sequence's block table.

Speculation (the policy) decides which sequences propose this step, and how many tokens:
one more than the sequence last accepted, up to k (none for a while after proposals that
all failed); none while more than max_batch
sequences decode (verifying costs more than it saves once the step is no longer
bound by reading the weights: BENCHMARKS.md, speculative decoding), none for a request
that opted out, and never past max_gen_len or max_seq_len."""

from array import array
import torch

from batch import Batch
from sequence import Sequence

MAX_PAUSE = 16  # steps a sequence whose proposals keep failing goes without proposing

class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        return [ngram_lookup(seq.prompt_tokens + seq.tokens, seq.draft_room, self.min_n, self.max_n)
                for seq in seqs]


def ngram_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
    (max_n down to min_n) that tokens end with; [] if none occurred. The search runs on the
    tokens' bytes (bytes.rfind, in C): a match must start on a token's boundary."""
    data = array("i", tokens).tobytes()
    width = array("i").itemsize
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = data[-n * width:]
        end = len(data) - width  # an occurrence followed by at least one token, not the suffix itself
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % width == 0:
                follow = at // width + n
                return tokens[follow:follow + k]
            end = at + len(pattern) - 1
    return []


class DraftProposer:
    """A draft model's runner (runner.ModelRunner with as many blocks of the same size as the
    target's, so that a sequence's block table addresses both caches) proposing greedily."""

    def __init__(self, runner):
        self.runner = runner

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's draft_room next tokens, the draft model's most probable ones. The
        first pass computes what the draft's cache lacks (the whole prompt, the first time;
        the tokens accepted since), each further pass one token per sequence."""
        size = self.runner.block_size
        # decode rows (a draft one token behind) first
        going = sorted(seqs, key=lambda s: len(s.prompt_tokens) + len(s.tokens) - s.draft_cached > 1)
        batch = Batch(tokens=[], positions=[], slots=[], logits_at=[])
        for seq in going:
            tokens = (seq.prompt_tokens + seq.tokens)[seq.draft_cached:]
            batch.add(tokens, seq.draft_cached, seq.table.blocks, size, decode=len(tokens) == 1)
            batch.logits_at.append(len(batch.tokens) - 1)
        drafts = {s: [] for s in seqs}  # a Sequence hashes by identity
        logits = self.runner.forward_batch(batch)
        while True:
            for seq, token in zip(going, logits.argmax(dim=-1).tolist()):
                drafts[seq].append(token)
                seq.draft_cached = len(seq.prompt_tokens) + len(seq.tokens) + len(drafts[seq]) - 1
            going = [s for s in going if len(drafts[s]) < s.draft_room]
            if not going:
                break
            batch = Batch(tokens=[], positions=[], slots=[])
            for seq in going:
                batch.add(drafts[seq][-1:], seq.draft_cached, seq.table.blocks, size, decode=True)
            logits = self.runner.forward_batch(batch)
        return [drafts[s] for s in seqs]


class Speculation:
    """Which sequences propose tokens this step, and how many (Sequence.draft_room), and the
    counts that metrics report."""

    def __init__(self, proposer, k: int, max_batch: int, max_seq_len: int):
        self.proposer, self.k, self.max_batch, self.max_seq_len = proposer, k, max_batch, max_seq_len
        self.proposed = self.accepted = self.verified = 0  # tokens; sequence-steps with a proposal

    def reserve(self, decoding: list[Sequence]):
        """Set each decoding sequence's draft_room before the scheduler makes room for it."""
        on = len(decoding) <= self.max_batch
        for seq in decoding:
            if seq.draft_pause:  # its last proposals all failed: it waits a few steps
                seq.draft_pause -= 1
                seq.draft_room = 0
                continue
            length = len(seq.prompt_tokens) + len(seq.tokens)
            left = min(seq.params.max_gen_len - len(seq.tokens), self.max_seq_len - length) - 1
            seq.draft_room = max(0, min(seq.draft_limit or self.k, left)) if on and seq.params.speculative else 0

    def propose(self, seqs: list[Sequence]):
        """Fill seq.draft for the sequences with room (the scheduler may have cut it)."""
        seqs = [s for s in seqs if s.draft_room]
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs)):
            seq.draft = draft[:seq.draft_room]
            self.proposed += len(seq.draft)
            self.verified += bool(seq.draft)

    def record(self, seq: Sequence, accepted: int):
        """After seq verified its proposal: it next proposes one token more than it had
        accepted (at most k), so that a sequence whose proposals fail verifies few tokens;
        after proposals that all failed it proposes nothing for 1, 2, 4, ... (at most
        MAX_PAUSE) steps, as long as they keep failing."""
        self.accepted += accepted
        seq.draft_limit = min(self.k, accepted + 1)
        seq.draft_failures = 0 if accepted else seq.draft_failures + 1
        seq.draft_pause = min(MAX_PAUSE, 1 << seq.draft_failures >> 1)

    @property
    def mean_accepted(self) -> float:
        """Proposed tokens accepted per step of a sequence that verified some."""
        return self.accepted / self.verified if self.verified else 0.0
