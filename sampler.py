"""The sampling math: batched tensor functions, one row per sequence: logit_bias,
penalties, a grammar's mask and min_tokens (adjust_logits), then greedy or a draw after
temperature, top-k and top-p (sample), and the logprobs of the raw logits."""

import torch
import torch.nn.functional as F

from batch import to_device
from sequence import Sequence
from structured import apply_bitmask


TOP_P_CANDIDATES = 64  # the most probable tokens looked at first for the top-p set (a sort of all is the fallback)


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


def top_p_least(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(b, 1): the least probability in each row's top-p set. The set is found among the
    TOP_P_CANDIDATES most probable tokens when they hold it (a top-k costs a thirtieth of a
    sort of 50k tokens), else among all."""
    top = torch.topk(probs, min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
    count = top_p_count(top, p)
    if bool((count < top.shape[-1]).all()):  # every set ends before the last candidate
        return top.gather(-1, count - 1)
    probs_sort = torch.sort(probs, dim=-1, descending=True).values
    return probs_sort.gather(-1, top_p_count(probs_sort, p) - 1)


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
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
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


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each row's next token (b,): the most probable one where the temperature is 0, else a
    draw after temperature, top-k and top-p, from the sequence's own generator when it has a
    seed (so that its tokens do not depend on the other rows).

    A draw is an exponential race, as vLLM's sampler makes it: each token of the vocabulary
    draws q = -log(u), u uniform (so q ~ Exp(1)), in token-id order, and the token of the
    top-p set with the largest p / q wins (token t with probability p_t over the set's mass).
    Draws follow the token ids, not the order of a sort, and tokens as probable as the last
    one of the top-p set stay in with it: two tokens of equal probability that trade places
    under rounding (in another batch, at another TP size) change neither the set nor the
    winner. A row costs its generator one draw of the vocabulary, whatever else the step
    holds: a proposed token (speculative decoding) stands when the draw gives it."""
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
    least = top_p_least(probs, to_device([p.top_p for p in params], device, probs.dtype)[:, None])
    kept = probs.masked_fill((probs < least) | (probs == 0), 0.0)
    q = torch.stack([torch.empty_like(probs[0]).uniform_(generator=seqs[i].generator) for i in rows]).log_().neg_()
    # masked after dividing: a draw of q = 0 makes 0 / 0
    tokens[index] = (kept / q).masked_fill_(kept == 0, -1.0).argmax(dim=-1)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[list[float], list[list]]:
    """Log-probabilities (log_softmax of the raw logits, b x vocab) of tokens (b,), and each
    row's top most probable tokens as [(id, logprob), ...], most probable first."""
    logprobs = F.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    if top == 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
