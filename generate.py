"""Generation: sampling, the Sequence that a generation builds up, and the seed
functions generate/text_completion/chat_completion, which run a whole batch through the
engine (engine.py) with the semantics of Meta's reference code."""

from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch
import torch.nn.functional as F

import chat_format
from kv_cache import BlockTable
from tokenizer import TextStream

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    role: Role
    content: str


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: list[str]
    logprobs: list[float]
    finish_reason: str
    usage: dict


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: list[str]
    logprobs: list[float]
    finish_reason: str
    usage: dict


Dialog = list[Message]

def sample_top_p(probs: torch.Tensor, p, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample from the smallest set of most probable tokens whose probability reaches p
    (the token that crosses p stays in), renormalised. probs: (batch, vocab); p: a float, or
    one per row (batch, 1) -> (batch, 1)."""
    probs_sort, probs_idx = nucleus(probs, p)
    next_token = torch.multinomial(probs_sort, num_samples=1, generator=generator)
    return torch.gather(probs_idx, -1, next_token)


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


# --- the sampling math: batched, one row per sequence, the same on every rank --------------

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


def adjust_logits(logits: torch.Tensor, seqs: list["Sequence"]) -> torch.Tensor:
    """The logits that each sequence samples from (the raw ones stay for logprobs): its
    logit_bias added, then its penalties (vLLM's order), and its stop ids masked while it
    has fewer than min_tokens tokens. Rows without such settings are left as they are."""
    biased = [i for i, s in enumerate(seqs) if s.bias is not None]
    penalized = [i for i, s in enumerate(seqs) if s.counts is not None]
    blocked = [i for i, s in enumerate(seqs) if len(s.tokens) < s.params.min_tokens and s.stop_ids]
    if not (biased or penalized or blocked):
        return logits
    logits = logits.clone()
    if biased:
        logits[biased] += torch.stack([seqs[i].bias for i in biased])
    if penalized:
        params = [seqs[i].params for i in penalized]
        settings = torch.tensor([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                                dtype=logits.dtype, device=logits.device)
        logits[penalized] = apply_penalties(logits[penalized], torch.stack([seqs[i].counts for i in penalized]),
                                            torch.stack([seqs[i].seen for i in penalized]), *settings.T)
    if blocked:
        banned = torch.zeros(len(blocked), logits.shape[-1], dtype=torch.bool, device=logits.device)
        for row, i in enumerate(blocked):
            banned[row, list(seqs[i].stop_ids)] = True
        logits[blocked] = mask_tokens(logits[blocked], banned)
    return logits


def sample(logits: torch.Tensor, seqs: list["Sequence"]) -> torch.Tensor:
    """Each row's next token (b,): the most probable one where the temperature is 0, else a
    draw after temperature, top-k and top-p, from the sequence's own generator when it has a
    seed (so that its tokens do not depend on the other rows).

    A draw is an exponential race, as vLLM's sampler makes it: each token of the vocabulary
    draws q ~ Exp(1), in token-id order, and the token of the top-p set with the largest
    p / q wins (token t with probability p_t over the set's mass). Draws follow the token
    ids, not the order of a sort, and tokens as probable as the last one of the top-p set
    stay in with it: two tokens of equal probability that trade places under rounding
    (in another batch, at another TP size) change neither the set nor the winner."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
    if not rows:
        return tokens
    params = [seqs[i].params for i in rows]
    scaled = logits[rows] / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    if any(p.top_k > 0 for p in params):
        scaled = top_k_filter(scaled, torch.tensor([p.top_k for p in params], device=logits.device))
    probs = torch.softmax(scaled, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=logits.device)[:, None]
    probs_sort = torch.sort(probs, dim=-1, descending=True).values
    least = probs_sort.gather(-1, top_p_count(probs_sort, top_p) - 1)  # the top-p set's least probability
    q = torch.stack([torch.empty_like(probs[0]).exponential_(generator=seqs[i].generator) for i in rows])
    outside = (probs < least) | (probs == 0)  # masked after dividing: a draw of q = 0 makes 0 / 0
    tokens[rows] = (probs / q).masked_fill_(outside, -1.0).argmax(dim=-1)
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


@dataclass
class SamplingParams:
    max_gen_len: int
    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also this many most probable tokens at each position
    echo: bool = False  # with logprobs: the prompt's too
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0  # OpenAI's, on generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's, on prompt and generated tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id: added to its logit
    min_tokens: int = 0  # no stop id, and no stop string, ends the generation before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the generation
    ignore_eos: bool = False  # the tokenizer's stop ids do not end it (stop_token_ids still do)
    # True: the text continues the prompt (text completion: prompt + text is what prompt and
    # new tokens decode to). False: the text is what the new tokens decode to on their own
    # (a chat message, as Meta's reference decodes an answer: no space left over from the layout).
    continue_prompt: bool = True


@dataclass(eq=False)
class Sequence:
    """One prompt's generation: its tokens so far, its text, and when it stopped; the
    engine keeps its KV-cache blocks (table) and how many of its tokens are cached."""
    prompt_tokens: list[int]
    params: SamplingParams
    id: int  # in the order sequences were added
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    stop_token: int | None = None  # the stop id that ended it (not in tokens)
    # with params.logprobs, one entry per sampled token (tokens, then stop_token): its
    # logprob, the most probable tokens [(id, logprob), ...] and where its text starts in text
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # with echo: 0.0 for the first token
    prompt_top_logprobs: list[list] = field(default_factory=list)
    stream: TextStream | None = None  # turns tokens into text (set by Engine.add)
    text: str = ""  # the generation's text so far, cut before a stop string
    finish_reason: str | None = None
    emitted: int = 0  # characters of text already handed out by new_text()
    stop_ends: "StopEnds | None" = None  # how much of each stop string text ends in
    # sampling state (set by Engine.add): the ids that end it, and (vocab,) tensors where
    # its settings need them: logit_bias, generated-token counts and tokens seen for penalties
    stop_ids: frozenset = frozenset()
    bias: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    table: BlockTable | None = None  # set by the engine's scheduler
    cached: int = 0  # tokens whose keys and values are in the cache

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.logprobs and self.params.echo

    @property
    def sampled(self) -> list[int]:
        """Every sampled token: tokens, then the stop id that ended it (what vLLM returns)."""
        return self.tokens + ([] if self.stop_token is None else [self.stop_token])

    def add_text(self, piece: str):
        """Append decoded text; a stop string in it ends the generation, cut before it.
        Only the text a stop string could end in is searched, and none before min_tokens."""
        if not piece or self.finish_reason == "stop":
            return
        if self.params.stop:
            if self.stop_ends is None:
                self.stop_ends = StopEnds(self.params.stop)
            self.stop_ends.feed(piece)
        if len(self.tokens) < self.params.min_tokens:
            self.text += piece
            return
        longest = max(map(len, self.params.stop), default=0)
        start = max(0, len(self.text) - longest + 1)
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.finish_reason = "stop"

    def new_text(self) -> str:
        """Text produced since the last call. While running, holds back what could still
        turn out to be the start of a stop string."""
        end = len(self.text)
        if not self.done and self.stop_ends is not None:
            end -= self.stop_ends.held_back()
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece


class StopEnds:
    """For each stop string, the longest of its prefixes that the text so far ends in,
    fed the text piece by piece (Knuth-Morris-Pratt): each piece costs its length times
    the number of stop strings, however long the text and the stop strings."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.borders = [prefix_function(stop) for stop in stops]
        self.ends = [0] * len(stops)
        self.longest = max(map(len, stops))

    def feed(self, piece: str):
        for i, (stop, border) in enumerate(zip(self.stops, self.borders)):
            q = self.ends[i]
            for c in piece:
                if q == len(stop):  # a whole match (before min_tokens): go on from its border
                    q = border[q - 1]
                while q and stop[q] != c:
                    q = border[q - 1]
                if stop[q] == c:
                    q += 1
            self.ends[i] = q

    def held_back(self) -> int:
        """How many characters at the end of the text could be the start of a stop string
        (at most the longest one's length less one)."""
        return max(q if q < self.longest else border[q - 1] for q, border in zip(self.ends, self.borders))


def prefix_function(s: str) -> list[int]:
    """border[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    border = [0] * len(s)
    for i in range(1, len(s)):
        q = border[i - 1]
        while q and s[q] != s[i]:
            q = border[q - 1]
        border[i] = q + (s[q] == s[i])
    return border


def new_engine(model, tokenizer):
    from engine import Engine  # engine.py builds on this module

    return Engine(model, tokenizer)


def run_to_completion(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
    """Meta's semantics: the whole batch at once, at most max_batch_size prompts."""
    if len(prompts) > engine.scheduler.max_seqs:
        raise ValueError(f"{len(prompts)} prompts exceed max_batch_size {engine.model.params.max_batch_size}")
    for tokens, p in zip(prompts, params):  # all checks before any work
        engine.check(tokens, p)
    seqs = [engine.add(tokens, p) for tokens, p in zip(prompts, params)]
    try:
        while engine.running:
            engine.step()
    finally:
        for s in seqs:
            engine.release(s)
    return seqs


def sampling_params(prompts: list[list[int]], max_seq_len: int, max_gen_len, **options) -> list[SamplingParams]:
    """One SamplingParams per prompt. max_gen_len: an int, one per prompt, or None (up to
    the end of the context)."""
    if max_gen_len is None or isinstance(max_gen_len, int):
        max_gen_len = [max_gen_len] * len(prompts)
    if len(max_gen_len) != len(prompts):
        raise ValueError(f"{len(max_gen_len)} max_gen_len values for {len(prompts)} prompts")
    stop = options.pop("stop", None) or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)  # one string is one stop string
    return [SamplingParams(n if n is not None else max_seq_len - len(t), stop=stop, **options)
            for t, n in zip(prompts, max_gen_len)]


@torch.inference_mode()
def generate(model, prompt_tokens: list[list[int]], max_gen_len: int, temperature: float = 0.6,
             top_p: float = 0.9, logprobs: bool = False, echo: bool = False, *, tokenizer=None, **options) -> tuple:
    """Generate for a batch of prompts. Returns (tokens, logprobs or None) per prompt, as
    Meta's reference does: new tokens (after the prompt when echo), cut before EOS.
    model: the Llama that tp_llama returns (its tokenizer is used), or a Transformer with
    tokenizer=. options: SamplingParams fields (top_k, seed, stop, penalties, ...). More
    prompts than max_batch_size, or a prompt plus max_gen_len beyond max_seq_len, raise
    ValueError."""
    if tokenizer is None:
        if not hasattr(model, "tokenizer"):
            raise TypeError("generate() needs tokenizer= with a bare Transformer (a Llama brings its own)")
        model, tokenizer = model.model, model.tokenizer
    engine = new_engine(model, tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, echo=echo, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    out_tokens = [(s.prompt_tokens if echo else []) + s.tokens for s in seqs]
    out_logprobs = [(s.prompt_logprobs if echo else []) + s.logprobs[:len(s.tokens)] for s in seqs]
    return out_tokens, (out_logprobs if logprobs else None)


def prediction(seq: Sequence, tokenizer, generation) -> dict:
    """The answer for one sequence: generation, finish_reason, usage, and tokens and
    logprobs when asked for (cut before the stop id, as Meta's reference cuts them), with the
    most probable tokens at each position when top_logprobs is set."""
    out = {"generation": generation, "finish_reason": seq.finish_reason,
           "usage": {"prompt_tokens": len(seq.prompt_tokens), "completion_tokens": len(seq.tokens)}}
    p, n = seq.params, len(seq.tokens)
    if p.logprobs:
        tokens = (seq.prompt_tokens if p.echo else []) + seq.tokens
        out["tokens"] = [tokenizer.token_str(t) for t in tokens]
        out["logprobs"] = (seq.prompt_logprobs if p.echo else []) + seq.logprobs[:n]
        if p.top_logprobs:
            tops = (seq.prompt_top_logprobs if p.echo else []) + seq.top_logprobs[:n]
            out["top_logprobs"] = [[{"token": tokenizer.token_str(i), "logprob": v} for i, v in top] for top in tops]
    return out


@torch.inference_mode()
def text_completion(model, tokenizer, prompts: list[str], max_gen_len=None, temperature: float = 0.6,
                    top_p: float = 0.9, logprobs: bool = False, echo: bool = False,
                    **options) -> list[CompletionPrediction]:
    """Complete each prompt. max_gen_len: int, one per prompt, or None (to the end of the
    context). options: top_k, seed, stop (strings; the text is cut before them)."""
    prompt_tokens = [tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    engine = new_engine(model, tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, echo=echo, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    return [prediction(s, tokenizer, (prompt if echo else "") + s.text) for s, prompt in zip(seqs, prompts)]


@torch.inference_mode()
def chat_completion(model, tokenizer, dialogs: list[Dialog], max_gen_len=None, temperature: float = 0.6,
                    top_p: float = 0.9, logprobs: bool = False, **options) -> list[ChatPrediction]:
    """Answer each dialog as the assistant, in the checkpoint's chat format (chat_format.py)."""
    prompt_tokens = [chat_format.encode_dialog(tokenizer, d) for d in dialogs]
    engine = new_engine(model, tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, continue_prompt=False, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    return [prediction(s, tokenizer, {"role": "assistant", "content": s.text}) for s in seqs]
