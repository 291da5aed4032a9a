"""The sampling math: batched tensor functions, one row per sequence: logit_bias,
penalties, a grammar's mask and min_tokens (adjust_logits), then greedy or a draw after
temperature, top-k and top-p (sample), and the logprobs of the raw logits."""

import ctypes
import logging
import os
import threading

import torch
import torch.nn.functional as F

import cpp_ops
from batch import to_device
from sequence import Sequence
from structured import apply_bitmask


# the most probable tokens a draw looks at, then more of them, then the whole vocabulary,
# until its set lies among them (sorting 49,152 probabilities took 2.8 ms here, the 1024
# most probable 0.4; a set of top_p 0.9 at temperature 0.7 often reaches past 64)
CANDIDATES, NUCLEUS = 64, 1024
CDF_CHUNK = 512  # tokens whose mass is summed at once in inverse_cdf
TOPK_BLOCK = 128  # tokens per block in top_n's first pass
MASK32 = 0xFFFFFFFF
RACE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "race.cpp")

_race_lock = threading.Lock()
_race: ctypes.CDLL | None = None  # race.cpp, once loaded
_race_tried = False


def load_race() -> bool:
    """Whether race.cpp (the first look of a draw, on the CPU) is loaded: built on the first
    call (cpp_ops.build), else logged once and left to torch's operators."""
    global _race, _race_tried
    with _race_lock:
        if not _race_tried:
            _race_tried = True
            try:
                _race = ctypes.CDLL(cpp_ops.build(RACE_SOURCE, "the sampler's CPU code"))
                _race.among_candidates.restype = None
                _race.among_candidates.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                   ctypes.c_void_p, ctypes.c_void_p]
            except ValueError as e:
                logging.getLogger(__name__).warning("sampling with torch's operators: %s", e)
        return _race is not None


def race_candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor,
                    n: int = CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """among_candidates by race.cpp (CPU tensors; load_race() first): each row's drawn token
    and whether its set lies among its n most probable tokens."""
    scaled = scaled.float().contiguous()
    args = [t.contiguous() for t in (top_k.long(), top_p.float(), keys.long())]
    drawn = torch.empty(len(scaled), dtype=torch.long)
    found = torch.empty(len(scaled), dtype=torch.bool)
    _race.among_candidates(scaled.data_ptr(), len(scaled), scaled.shape[-1], args[0].data_ptr(), args[1].data_ptr(),
                           args[2].data_ptr(), min(n, scaled.shape[-1]), drawn.data_ptr(), found.data_ptr())
    return drawn, found


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
    (p <= 0 would keep none), never one of probability 0 (with p = 1, rounding leaves the
    mass before them just short of it)."""
    before = torch.cumsum(probs_sort, dim=-1) - probs_sort  # mass of the more probable tokens
    return ((before < p) & (probs_sort > 0)).sum(dim=-1, keepdim=True).clamp(min=1)


def mix32_(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of h, in place (int64 tensors holding 32-bit values; every
    product stays below 2**63). In place since a draw over the whole vocabulary hashes b x
    vocab ids: new tensors for each operation took 40 % longer."""
    for _ in range(2):
        h ^= h >> 16
        h *= 0x45D9F3B
        h &= MASK32
    h ^= h >> 16
    return h


def race_draws(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """q ~ Exp(1) for each token id of ids (b, n), from its row's keys (b, 2): a hash of the
    key and the id, so that a token's draw is the same whichever other tokens are looked at."""
    h = mix32_(ids ^ keys[:, :1])
    h ^= keys[:, 1:]
    return mix32_(h).double().add_(0.5).div_(2**32).log_().neg_()


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

    A draw is an exponential race, as vLLM's sampler makes it: each token draws q ~ Exp(1)
    and the token of the top-k and top-p set with the largest p / q wins (token t with
    probability p_t over the set's mass). A token's q is a hash of its id and a key that the
    row draws from its generator, one per step: it does not depend on the order of a sort, and
    tokens as probable as the last one of the set stay in with it, so two tokens of equal
    probability that trade places under rounding (in another batch, at another TP size)
    change neither the set nor the winner; the set is looked for among the CANDIDATES most
    probable tokens, then the NUCLEUS most probable, and among all where it reaches past
    them, with the same draws (on the CPU, the first look is race.cpp's op: one pass over the
    vocabulary instead of a hundred small operators). A row with top_p 1 and no top_k, whose
    set is the whole vocabulary whatever the logits, draws by inverting its distribution's
    CDF instead (one pass, where a race hashes every id: 0.7 ms a row here). A row costs its generator one
    key whatever else the step holds: a proposed token (speculative decoding) stands when
    the draw gives it."""
    device = logits.device
    tokens = torch.zeros(len(seqs), dtype=torch.long, device=device)
    greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
    if greedy:  # max's indices are argmax's (the first of equal maxima), 3x faster here at batch 8
        tokens[to_device(greedy, device)] = rows_of(logits, greedy).max(dim=-1).indices
    rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
    if not rows:
        return tokens
    params, index = [seqs[i].params for i in rows], to_device(rows, device)
    scaled = rows_of(logits, rows) / to_device([p.temperature for p in params], device)[:, None]
    top_k = to_device([p.top_k for p in params], device)
    top_p = to_device([p.top_p for p in params], device, scaled.dtype)[:, None]
    keys = torch.stack([torch.randint(0, MASK32 + 1, (2,), generator=seqs[i].generator) for i in rows]).to(device)
    drawn = torch.empty(len(rows), dtype=torch.long, device=device)
    # where a row's set lies: among the CANDIDATES most probable tokens, else among the
    # NUCLEUS most probable, else among all; a row with top_p 1 and no top_k looks among all
    # at once (its set is every token of probability above 0)
    looks = [p.top_p < 1 or 0 < p.top_k < scaled.shape[-1] for p in params]
    left = [j for j, look in enumerate(looks) if look]
    sizes = (CANDIDATES, NUCLEUS)
    if left and device.type == "cpu" and load_race():  # the first look in one op (race.cpp)
        some = to_device(left, device)
        some_drawn, found = race_candidates(rows_of(scaled, left), top_k[some], top_p[some], keys[some])
        drawn[some] = some_drawn
        left, sizes = [j for j, inside in zip(left, found.tolist()) if not inside], (NUCLEUS,)
    if left:  # the log of each row's total mass, for the candidates' probabilities
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    for n in sizes:
        if not left:
            break
        some = to_device(left, device)
        some_drawn = torch.empty(len(left), dtype=torch.long, device=device)
        found = among_candidates(rows_of(scaled, left), top_k[some], top_p[some], keys[some], some_drawn,
                                 rows_of(lse, left), n)
        drawn[some] = some_drawn
        left = [j for j, inside in zip(left, found.tolist()) if not inside]
    everything = [j for j, look in enumerate(looks) if not look]
    if everything:
        some = to_device(everything, device)
        drawn[some] = inverse_cdf(rows_of(scaled, everything), keys[some])
    if left:
        rest = to_device(left, device)
        drawn[rest] = among_all(scaled[rest], top_k[rest], top_p[rest], keys[rest])
    tokens[index] = drawn
    return tokens


def rows_of(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows (ascending, no repeats): t itself where they are all of them, else a copy."""
    return t if len(rows) == len(t) else t[to_device(rows, t.device)]


def top_n(scaled: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scaled, n, dim=-1), looked for only in the n blocks of TOPK_BLOCK tokens with
    the largest maxima: the block of one of the n largest values has fewer than n blocks of
    larger maxima, each holding a larger value. Where the blocks are not many more than n,
    topk over all of them costs no more."""
    b, vocab = scaled.shape
    if vocab % TOPK_BLOCK or vocab // TOPK_BLOCK <= 4 * n:
        return torch.topk(scaled, n, dim=-1)
    blocks = scaled.view(b, -1, TOPK_BLOCK)
    best = blocks.amax(dim=-1).topk(n, dim=-1).indices  # (b, n)
    inside = blocks.gather(1, best[:, :, None].expand(-1, -1, TOPK_BLOCK)).view(b, -1)
    values, at = inside.topk(n, dim=-1)
    return values, best.gather(1, at // TOPK_BLOCK) * TOPK_BLOCK + at % TOPK_BLOCK


def among_candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor,
                     drawn: torch.Tensor, lse: torch.Tensor, n: int = CANDIDATES) -> torch.Tensor:
    """Draws each row's token among its n most probable ones into drawn; returns which rows'
    sets lie within them (the others' drawn entries mean nothing). lse: logsumexp of each row
    (b, 1)."""
    vocab = scaled.shape[-1]
    n = min(n, vocab)
    values, ids = top_n(scaled, n)
    cut = ((top_k > 0) & (top_k < vocab))[:, None]  # a top_k that leaves tokens out
    k = torch.where(cut[:, 0] & (top_k <= n), top_k, n)[:, None]
    in_top_k = values >= values.gather(-1, k - 1)  # ties at the k-th stay in
    # probabilities over the top-k set (over all tokens without one), as a softmax of it gives them
    norm = torch.where(cut, torch.logsumexp(values.masked_fill(~in_top_k, float("-inf")), -1, keepdim=True), lse)
    probs = (values - norm).exp_().masked_fill_(~in_top_k, 0.0)
    least = probs.gather(-1, top_p_count(probs, top_p) - 1)
    # outside the candidates every token is at most as probable as the last one: the set lies
    # within them if that one is out of it, by top-p or by a top_k of at most n
    outside = torch.where(~in_top_k[:, -1:], 0.0, probs[:, -1:])
    found = ((outside < least) & ~(cut & (top_k[:, None] > n)))[:, 0] | (n == vocab)
    drawn.copy_(race(probs.masked_fill(probs < least, 0.0), ids, keys))
    return found


def among_all(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn among the whole vocabulary."""
    if (top_k > 0).any():
        scaled = top_k_filter(scaled, top_k)
    probs = torch.softmax(scaled, dim=-1)
    least = torch.zeros_like(top_p)  # top_p 1: every token
    if (top_p < 1).any():
        probs_sort = torch.sort(probs, dim=-1, descending=True).values
        least = torch.where(top_p < 1, probs_sort.gather(-1, top_p_count(probs_sort, top_p) - 1), least)
    ids = torch.arange(scaled.shape[-1], device=scaled.device).expand(len(scaled), -1)
    return race(probs.masked_fill(probs < least, 0.0), ids, keys)


def inverse_cdf(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn from softmax(scaled): where its CDF (in token id order, not
    normalised) first passes u times its total, u a uniform in (0, 1) of 53 bits made from
    the row's keys (b, 2). The CDF is summed over chunks of CDF_CHUNK tokens, then within
    the one chunk it falls in, in double (a cumulative sum of the whole vocabulary, one token
    after another, took 1.1 ms for 8 rows here)."""
    b, vocab = scaled.shape
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    if vocab % CDF_CHUNK:
        weights = F.pad(weights, (0, -vocab % CDF_CHUNK))
    chunks = weights.view(b, -1, CDF_CHUNK)
    before = F.pad(chunks.sum(dim=-1).double().cumsum_(dim=-1), (1, 0))  # mass before each chunk
    target = uniforms(keys) * before[:, -1:]
    chunk = first_past(before[:, 1:].contiguous(), target)
    inside = chunks.gather(1, chunk[:, :, None].expand(-1, -1, CDF_CHUNK))[:, 0].cumsum(dim=-1, dtype=torch.float64)
    return (chunk * CDF_CHUNK + first_past(inside, target - before.gather(1, chunk)))[:, 0]


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """(b, 1): each row's u in (0, 1), float64, of 53 bits from its keys (b, 2)."""
    bits = keys[:, :1] * 2**21 + (keys[:, 1:] >> 11)  # below 2**53: exact in a double
    return (bits.double() + 0.5) / 2**53


def first_past(cdf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(b, 1): the first index of each row of cdf (b, n, non-decreasing) above value (b, 1),
    or where the row reaches its total if rounding leaves value past it: a step of 0 (a
    token or chunk of probability 0) is never the answer."""
    total = cdf[:, -1:].contiguous()
    return torch.minimum(torch.searchsorted(cdf, value, right=True), torch.searchsorted(cdf, total))


def race(kept: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The token (of ids) whose kept probability over its draw is the largest, per row."""
    q = race_draws(keys, ids)
    # masked after dividing: a probability of 0 is out, whatever its draw
    return ids.gather(-1, (kept.double() / q).masked_fill_(kept == 0, -1.0).argmax(dim=-1, keepdim=True))[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[list[float], list[list]]:
    """Log-probabilities (log_softmax of the raw logits, b x vocab) of tokens (b,), and each
    row's top most probable tokens as [(id, logprob), ...], most probable first."""
    logprobs = F.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    if top == 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
