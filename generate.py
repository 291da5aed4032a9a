"""The seed functions generate/text_completion/chat_completion (and sample_top_p), which
run a whole batch through the engine (engine.py) with the semantics of Meta's reference
code, and the answer for a finished sequence (prediction)."""

from typing import Literal, TypedDict

import torch

import chat_format
from engine import Engine
from sampler import nucleus
from sequence import SamplingParams, Sequence

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


def runner_of(model):
    """The runner.ModelRunner to run: a Llama's or a llama2.Transformer's (tp_llama's, or the
    one a Transformer made for itself), or model itself."""
    runner = getattr(model, "runner", model)
    if not hasattr(runner, "forward_batch"):
        raise TypeError(f"expected a Llama, a llama2.Transformer or a ModelRunner, got {type(model).__name__}")
    return runner


def run_to_completion(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
    """Meta's semantics: the whole batch at once, at most max_batch_size prompts."""
    if len(prompts) > engine.scheduler.max_seqs:
        raise ValueError(f"{len(prompts)} prompts exceed max_batch_size {engine.scheduler.max_seqs}")
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
    model: the Llama that tp_llama returns or its model (their tokenizer is used), or a
    runner.ModelRunner or a bare llama2.Transformer with tokenizer=. options: SamplingParams fields (top_k, seed, stop, penalties, ...). More
    prompts than max_batch_size, or a prompt plus max_gen_len beyond max_seq_len, raise
    ValueError."""
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise TypeError(f"generate() needs tokenizer= with a {type(model).__name__} that has none "
                        "(tp_llama's Llama and its model bring their own)")
    engine = Engine(runner_of(model), tokenizer)
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
    engine = Engine(runner_of(model), tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, echo=echo, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    return [prediction(s, tokenizer, (prompt if echo else "") + s.text) for s, prompt in zip(seqs, prompts)]


@torch.inference_mode()
def chat_completion(model, tokenizer, dialogs: list[Dialog], max_gen_len=None, temperature: float = 0.6,
                    top_p: float = 0.9, logprobs: bool = False, **options) -> list[ChatPrediction]:
    """Answer each dialog as the assistant, in the checkpoint's chat format (chat_format.py)."""
    prompt_tokens = [chat_format.encode_dialog(tokenizer, d) for d in dialogs]
    engine = Engine(runner_of(model), tokenizer)
    params = sampling_params(prompt_tokens, engine.max_seq_len, max_gen_len, temperature=temperature,
                             top_p=top_p, logprobs=logprobs, continue_prompt=False, **options)
    seqs = run_to_completion(engine, prompt_tokens, params)
    return [prediction(s, tokenizer, {"role": "assistant", "content": s.text}) for s in seqs]
