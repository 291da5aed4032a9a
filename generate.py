"""Generation: sampling and an Engine that decodes many sequences together, each in its
own KV-cache row, so that sequences can join and leave between steps (continuous
batching). generate/text_completion/chat_completion run a whole batch through it with the
semantics of Meta's reference code."""

import heapq
from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import chat_format
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


@dataclass
class Sequence:
    """One prompt's generation: its KV-cache row, its tokens so far, and when it stopped."""
    prompt_tokens: list[int]
    params: SamplingParams
    slot: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    stream: TextStream | None = None  # turns tokens into text (set by Engine.add)
    text: str = ""  # the generation's text so far, cut before a stop string
    finish_reason: str | None = None
    emitted: int = 0  # characters of text already handed out by new_text()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def cache_len(self) -> int:
        """Tokens whose keys and values are in the cache; the last sampled one is not yet."""
        return len(self.prompt_tokens) + len(self.tokens) - 1

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


class Engine:
    """Decodes sequences that each own one KV-cache row (slot). add() prefills a prompt and
    samples its first token; step() gives every running sequence one more token. Every
    tensor-parallel rank must make the same calls in the same order; sampled tokens are
    broadcast from rank 0 so that all ranks feed the model the same tokens."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.tok_embeddings.weight.device
        self.max_seq_len = model.params.max_seq_len
        self.free_slots = list(range(model.params.max_batch_size))
        self.sequences: dict[int, Sequence] = {}  # by slot

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.sequences.values() if not s.done]

    def check(self, prompt_tokens: list[int], max_gen_len: int):
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if max_gen_len < 1:
            raise ValueError(f"max_gen_len must be at least 1, got {max_gen_len}")
        if len(prompt_tokens) + max_gen_len > self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens + {max_gen_len} new tokens exceeds "
                             f"max_seq_len {self.max_seq_len}")

    def add(self, prompt_tokens: list[int], params: SamplingParams) -> Sequence:
        self.check(prompt_tokens, params.max_gen_len)
        if not self.free_slots:
            raise RuntimeError("no free KV-cache slot")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        seq = Sequence(list(prompt_tokens), params, heapq.heappop(self.free_slots), generator,
                       stream=TextStream(self.tokenizer, prompt_tokens if params.continue_prompt else []))
        self.sequences[seq.slot] = seq
        tokens = torch.tensor([seq.prompt_tokens], device=self.device)
        logits = self.model(tokens, 0, slot=seq.slot)[0]
        if params.logprobs and params.echo:
            prompt_lp = F.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[0, 1:, None])[:, 0]
            seq.prompt_logprobs = [0.0] + prompt_lp.tolist()  # nothing predicts the first token
        self._advance([seq], logits[-1:])
        return seq

    def step(self):
        """One token for every running sequence, in one forward pass over the cache rows
        up to the highest one in use (free rows in between compute a throwaway token)."""
        running = self.running
        if not running:
            return
        rows = max(s.slot for s in running) + 1
        tokens = torch.zeros(rows, 1, dtype=torch.long)
        positions = [0] * rows
        for s in running:
            tokens[s.slot, 0] = s.tokens[-1]
            positions[s.slot] = s.cache_len
        logits = self.model(tokens.to(self.device), positions)[:, -1]
        self._advance(running, logits[[s.slot for s in running]])

    def release(self, seq: Sequence):
        if self.sequences.pop(seq.slot, None) is seq:
            heapq.heappush(self.free_slots, seq.slot)

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor):
        next_tokens = torch.stack([self._sample(row, s) for row, s in zip(logits, seqs)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(next_tokens, src=0)
        want_logprobs = any(s.params.logprobs for s in seqs)
        if want_logprobs:
            chosen = F.log_softmax(logits, dim=-1).gather(-1, next_tokens[:, None])[:, 0].tolist()
        for i, (s, token) in enumerate(zip(seqs, next_tokens.tolist())):
            self._append(s, token, chosen[i] if want_logprobs else None)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        p = seq.params
        if p.temperature == 0:
            return logits.argmax()
        logits = logits / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        return sample_top_p(probs[None], p.top_p, seq.generator)[0, 0]

    def _append(self, seq: Sequence, token: int, logprob: float | None):
        if token in self.tokenizer.stop_ids:
            seq.add_text(seq.stream.flush())
            seq.finish_reason = "stop"
            return
        seq.tokens.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        seq.add_text(seq.stream.add(token))
        if not seq.done and len(seq.tokens) >= seq.params.max_gen_len:
            seq.add_text(seq.stream.flush())
            if not seq.done:
                seq.finish_reason = "length"


def run_to_completion(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
    if len(prompts) > len(engine.free_slots):
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
    engine = Engine(model, tokenizer)
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
    engine = Engine(model, tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, echo=echo, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    return [prediction(s, tokenizer, (prompt if echo else "") + s.text) for s, prompt in zip(seqs, prompts)]


@torch.inference_mode()
def chat_completion(model, tokenizer, dialogs: list[Dialog], max_gen_len=None, temperature: float = 0.6,
                    top_p: float = 0.9, logprobs: bool = False, **options) -> list[ChatPrediction]:
    """Answer each dialog as the assistant, in the checkpoint's chat format (chat_format.py)."""
    prompt_tokens = [chat_format.encode_dialog(tokenizer, d) for d in dialogs]
    engine = Engine(model, tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, continue_prompt=False, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    return [prediction(s, tokenizer, {"role": "assistant", "content": s.text}) for s in seqs]
