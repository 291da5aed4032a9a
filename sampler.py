"""The sampling math: batched tensor functions, one row per sequence: logit_bias,
penalties, a grammar's mask and min_tokens (adjust_logits), then greedy or a draw after
temperature, top-k and top-p (sample), and the logprobs of the raw logits."""

import torch
import torch.nn.functional as F

from batch import to_device
from sequence import Sequence
from structured import apply_bitmask


def nucleus(probs: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor]:
    """probs sorted in descending order with the tokens outside the top-p set zeroed and the
    rest renormalised, and the sorted tokens' ids."""
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    kept = torch.arange(probs.shape[-1], device=probs.device) < top_p_count(probs_sort, p)
    probs_sort = probs_sort.masked_fill(~kept, 0.0)
    return probs_sort / probs_sort.sum(dim=-1, keepdim=True), probs_idx


def top_p_count(probs_sort: torch.Tensor, p) -> torch.Tensor:
    """(..., 1): how many of the most probable tokens (probs_sort, descending) the top-p set
    holds: those whose more probable tokens have less than p of the mass, at least one
    (p <= 0 would keep none)."""
    before = torch.cumsum(probs_sort, dim=-1) - probs_sort  # mass of the more probable tokens
    return (before < p).sum(dim=-1, keepdim=True).clamp(min=1)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits (b, vocab) with each row's penalties: vLLM's repetition penalty on every token
    seen (b, vocab: in the prompt or generated), dividing positive logits and multiplying
    negative ones; then OpenAI's frequency and presence penalties on the generated tokens,
    logit - counts * frequency - (counts > 0) * presence (counts: b, vocab). presence,
    frequency, repetition: (b,)."""
    repetition = repetition[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - counts * frequency[:, None] - (counts > 0).to(logits.dtype) * presence[:, None]


def mask_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """logits with the tokens of banned (b, vocab, bool) at -inf: they cannot be sampled."""
    return logits.masked_fill(banned, float("-inf"))


def top_k_filter(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each row's k (b,) most probable tokens kept (ties at the k-th kept too), the others at
    -inf; k <= 0 keeps every token."""
    vocab = logits.shape[-1]
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The logits that each sequence samples from (the raw ones stay for logprobs): its
    logit_bias added, then its penalties (vLLM's order), the tokens its grammar forbids
    (bitmask: structured.py's, one row per sequence) and its stop ids masked while it has
    fewer than min_tokens tokens. Rows without such settings are left as they are."""
    biased = [i for i, s in enumerate(seqs) if s.bias is not None]
    penalized = [i for i, s in enumerate(seqs) if s.counts is not None]
    blocked = [i for i, s in enumerate(seqs) if len(s.tokens) < s.params.min_tokens and s.stop_ids]
    if not (biased or penalized or blocked or bitmask is not None):
        return logits
    logits = logits.clone()
    if biased:
        logits[to_device(biased, logits.device)] += torch.stack([seqs[i].bias for i in biased])
    if penalized:
        params = [seqs[i].params for i in penalized]
        settings = to_device([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                             logits.device, logits.dtype)
        logits[penalized] = apply_penalties(logits[penalized], torch.stack([seqs[i].counts for i in penalized]),
                                            torch.stack([seqs[i].seen for i in penalized]), *settings.T)
    if bitmask is not None:
        apply_bitmask(logits, bitmask)
    if blocked:
        banned = torch.zeros(len(blocked), logits.shape[-1], dtype=torch.bool, device=logits.device)
        for row, i in enumerate(blocked):
            banned[row, list(seqs[i].stop_ids)] = True
        held = mask_tokens(logits[blocked], banned)
        # where a grammar allows a stop id alone, it ends the text before min_tokens: no token would be left
        logits[blocked] = torch.where((held == float("-inf")).all(-1, keepdim=True), logits[blocked], held)
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], drafts: list[int | None] | None = None) -> torch.Tensor:
    """Each row's next token (b,): the most probable one where the temperature is 0, else a
    draw after temperature, top-k and top-p, from the sequence's own generator when it has a
    seed (so that its tokens do not depend on the other rows).

    A draw is an exponential race, as vLLM's sampler makes it: each token of the vocabulary
    draws q ~ Exp(1), in token-id order, and the token of the top-p set with the largest
    p / q wins (token t with probability p_t over the set's mass). Draws follow the token
    ids, not the order of a sort, and tokens as probable as the last one of the top-p set
    stay in with it: two tokens of equal probability that trade places under rounding
    (in another batch, at another TP size) change neither the set nor the winner.

    drafts: a proposed token per row, or None (speculative decoding). A greedy row's
    proposal stands if it is the most probable token; a sampled row's with probability
    p(draft) (a proposal is one token, not a distribution: q(draft) = 1), else the row draws
    from the residual, p without the proposal, renormalised (Leviathan et al.'s rejection
    sampling): the tokens are distributed as without the proposal."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
    if not rows:
        return tokens
    params, device = [seqs[i].params for i in rows], logits.device
    index = to_device(rows, device)
    scaled = logits[index] / to_device([p.temperature for p in params], device)[:, None]
    if any(p.top_k > 0 for p in params):
        scaled = top_k_filter(scaled, to_device([p.top_k for p in params], device))
    probs = torch.softmax(scaled, dim=-1)
    top_p = to_device([p.top_p for p in params], device, probs.dtype)[:, None]
    probs_sort = torch.sort(probs, dim=-1, descending=True).values
    least = probs_sort.gather(-1, top_p_count(probs_sort, top_p) - 1)  # the top-p set's least probability
    kept = probs.masked_fill((probs < least) | (probs == 0), 0.0)
    accepted = {}
    if drafts is not None:
        accepted = accept_drafts(kept, [(j, drafts[i], seqs[i].generator) for j, i in enumerate(rows)
                                        if drafts[i] is not None])
    q = torch.stack([torch.empty_like(probs[0]).exponential_(generator=seqs[i].generator) for i in rows])
    # masked after dividing: a draw of q = 0 makes 0 / 0
    tokens[index] = (kept / q).masked_fill_(kept == 0, -1.0).argmax(dim=-1)
    for j, token in accepted.items():
        tokens[rows[j]] = token
    return tokens


def accept_drafts(kept: torch.Tensor, drafts: list[tuple[int, int, torch.Generator | None]]) -> dict[int, int]:
    """The rows of kept (b, vocab: probabilities, not normalised) whose proposed token stands,
    each with probability p(token) = kept[token] / kept.sum(); drafts: (row, token,
    generator). A row whose proposal is rejected is left to draw from its residual."""
    accepted = {}
    for row, token, generator in drafts:
        u = torch.rand((), generator=generator, device=kept.device)
        if u * kept[row].sum() < kept[row, token]:
            accepted[row] = token
        else:
            residual(kept, row, token)
    return accepted


def residual(kept: torch.Tensor, row: int, token: int):
    """After a rejected proposal, the row's distribution is p - q clipped at 0, renormalised:
    with q all on the proposed token, p without it (written in place)."""
    kept[row, token] = 0.0


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[list[float], list[list]]:
    """Log-probabilities (log_softmax of the raw logits, b x vocab) of tokens (b,), and each
    row's top most probable tokens as [(id, logprob), ...], most probable first."""
    logprobs = F.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    if top == 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
