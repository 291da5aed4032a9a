"""Generation: sampling, the Sequence that a generation builds up, and the seed
functions generate/text_completion/chat_completion, which run a whole batch through the
engine (engine.py) with the semantics of Meta's reference code."""

from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch

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

def sample_top_p(probs: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample from the smallest set of most probable tokens whose probability reaches p
    (the token that crosses p stays in), renormalised. probs: (batch, vocab) -> (batch, 1)."""
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(probs_sort, dim=-1) - probs_sort  # mass of the more probable tokens
    drop = before >= p
    drop[..., 0] = False  # the most probable token always stays (p <= 0 would drop them all)
    probs_sort = probs_sort.masked_fill(drop, 0.0)
    probs_sort = probs_sort / probs_sort.sum(dim=-1, keepdim=True)
    next_token = torch.multinomial(probs_sort, num_samples=1, generator=generator)
    return torch.gather(probs_idx, -1, next_token)


@dataclass
class SamplingParams:
    max_gen_len: int
    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    logprobs: bool = False
    echo: bool = False
    stop: tuple[str, ...] = ()
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
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    stream: TextStream | None = None  # turns tokens into text (set by Engine.add)
    text: str = ""  # the generation's text so far, cut before a stop string
    finish_reason: str | None = None
    emitted: int = 0  # characters of text already handed out by new_text()
    table: BlockTable | None = None  # set by the engine's scheduler
    cached: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.logprobs and self.params.echo

    def add_text(self, piece: str):
        """Append decoded text; a stop string in it ends the generation, cut before it.
        Only the text a stop string could end in is searched."""
        if not piece or self.finish_reason == "stop":
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
        if not self.done:
            end -= held_back(self.text, self.params.stop)
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of text could be the start of a stop string."""
    for k in range(min(max(map(len, stops), default=1) - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-k:]) for stop in stops):
            return k
    return 0


def sample_token(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The next token of seq from its logits (vocab,): greedy at temperature 0, else
    temperature, top-k and top-p, drawn with the sequence's own generator when seeded."""
    p = seq.params
    if p.temperature == 0:
        return logits.argmax()
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)
    return sample_top_p(probs[None], p.top_p, seq.generator)[0, 0]


def new_engine(model, tokenizer):
    from engine import Engine  # engine.py builds on this module

    return Engine(model, tokenizer)


def run_to_completion(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
    """Meta's semantics: the whole batch at once, at most max_batch_size prompts."""
    if len(prompts) > engine.scheduler.max_seqs:
        raise ValueError(f"{len(prompts)} prompts exceed max_batch_size {engine.model.params.max_batch_size}")
    for tokens, p in zip(prompts, params):  # all checks before any work
        engine.check(tokens, p.max_gen_len)
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
             top_p: float = 0.9, logprobs: bool = False, echo: bool = False, *, tokenizer, **options) -> tuple:
    """Generate for a batch of prompts. Returns (tokens, logprobs or None) per prompt, as
    Meta's reference does: new tokens (after the prompt when echo), cut before EOS.
    options: top_k, seed, stop. More prompts than max_batch_size, or a prompt plus
    max_gen_len beyond max_seq_len, raise ValueError."""
    engine = new_engine(model, tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, echo=echo, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    out_tokens = [(s.prompt_tokens if echo else []) + s.tokens for s in seqs]
    out_logprobs = [(s.prompt_logprobs if echo else []) + s.logprobs for s in seqs]
    return out_tokens, (out_logprobs if logprobs else None)


def prediction(seq: Sequence, tokenizer, generation) -> dict:
    """The answer for one sequence: generation, finish_reason, usage, and tokens and
    logprobs when asked for."""
    out = {"generation": generation, "finish_reason": seq.finish_reason,
           "usage": {"prompt_tokens": len(seq.prompt_tokens), "completion_tokens": len(seq.tokens)}}
    if seq.params.logprobs:
        tokens = (seq.prompt_tokens if seq.params.echo else []) + seq.tokens
        out["tokens"] = [tokenizer.token_str(t) for t in tokens]
        out["logprobs"] = (seq.prompt_logprobs if seq.params.echo else []) + seq.logprobs
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
