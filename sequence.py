"""A sequence's sampling settings (SamplingParams) and its state as the engine builds it
up (Sequence): its tokens and logprobs, its text, stop strings, its KV-cache blocks."""

from dataclasses import dataclass, field

import torch

from kv_cache import BlockTable
from structured import Constraint, Matcher
from tokenizer import TextStream


# What a sampled token does to its sequence's grammar (Sequence.grammar_verdict)
GOES_ON, COMPLETE, BROKE = 0, 1, 2


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
    constraint: Constraint | None = None  # structured outputs: what the text must be, token by token
    speculative: bool = True  # False: never verify proposed tokens for it (where the engine speculates)


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
    stop_string: str | None = None  # the stop string that ended it (the text is cut before it)
    # with params.logprobs, one entry per sampled token (tokens, then stop_token): its
    # logprob, the most probable tokens [(id, logprob), ...] and where its text starts in text
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # with echo: 0.0 for the first token
    prompt_top_logprobs: list[list] = field(default_factory=list)
    stream: TextStream | None = None  # turns tokens into text (set by Engine.add)
    text: str = ""  # the generation's text so far, cut before a stop string
    finish_reason: str | None = None  # "stop", "length", or "error": its grammar broke (grammar_verdict)
    emitted: int = 0  # characters of text already handed out by new_text()
    stop_ends: "StopEnds | None" = None  # how much of each stop string text ends in
    # sampling state (set by Engine.add): the ids that end it, and (vocab,) tensors where
    # its settings need them: logit_bias, generated-token counts and tokens seen for penalties
    stop_ids: frozenset = frozenset()
    bias: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    # with params.constraint, on rank 0 (which computes the masks and says when a grammar
    # ends, for every rank): where the tokens so far are in its grammar
    matcher: Matcher | None = None
    table: BlockTable | None = None  # set by the engine's scheduler
    cached: int = 0  # tokens whose keys and values are in the cache
    ahead: int = 0  # tokens sampled whose ids are still on the device (asynchronous scheduling)
    # speculative decoding (speculative.py): how many proposed tokens this step may verify
    # (the scheduler reserves their blocks), the proposed tokens, the tokens whose keys
    # and values a draft model has in its own cache, and how much it proposes next
    draft_room: int = 0
    draft: list[int] = field(default_factory=list)
    draft_cached: int = 0
    draft_limit: int = 0  # the most tokens it proposes next step (0: the policy's k)
    draft_failures: int = 0  # verifications in a row that accepted nothing
    draft_pause: int = 0  # steps it goes without proposing

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ending(self) -> bool:
        """Whether the tokens sampled, on the host or not, reach max_gen_len: nothing more to compute."""
        return len(self.tokens) + self.ahead >= self.params.max_gen_len

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.logprobs and self.params.echo

    @property
    def scores_prompt(self) -> bool:
        """Whether the tokens computed for it score its prompt (every row's logits): echo with
        logprobs, until each prompt token has its logprob. A preempted sequence's recomputed
        prompt is not scored again, so that its logprobs come once."""
        return self.needs_prompt_logprobs and len(self.prompt_logprobs) < len(self.prompt_tokens)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Its tokens (prompt, then generated) from start to end, without joining the lists."""
        n = len(self.prompt_tokens)
        if start >= n:
            return self.tokens[start - n:end - n]
        return self.prompt_tokens[start:end] + self.tokens[:max(0, end - n)]

    def append(self, token: int, logprob: float | None = None, top: list | None = None, grammar: int = GOES_ON):
        """A sampled token (with its logprob and top logprobs where asked for): its text, the
        sampling state it changes (penalties' counts), and the end it may bring. grammar: what
        the token did to its grammar (grammar_verdict, rank 0's on every rank)."""
        offset = len(self.text)  # where its text starts (a character it ends is held back until then)
        if token in self.stop_ids:
            self.stop_token = token
            self.finish("error" if grammar == BROKE else "stop")
            offset = len(self.text)  # it adds no text
        else:
            self.tokens.append(token)
            if self.counts is not None:
                self.counts[token] += 1
                self.seen[token] = True
            self.add_text(self.stream.add(token))
            if grammar == BROKE:
                self.finish("error")  # a token the grammar refuses, or a limit of its parser reached
            elif grammar == COMPLETE:
                self.finish("stop")  # nothing but a stop id could follow
            elif len(self.tokens) >= self.params.max_gen_len:
                self.finish("length")
        if logprob is not None:
            self.logprobs.append(logprob)
            self.top_logprobs.append(top)
            self.text_offsets.append(offset)

    def finish(self, reason: str):
        """End it with reason, the text its stream held back flushed (a stop string in that
        text ends it with "stop" first)."""
        if not self.done:
            self.add_text(self.stream.flush())
        if not self.done:
            self.finish_reason = reason

    def grammar_verdict(self, token: int) -> int:
        """What token does to its grammar (rank 0's matcher, which consumes it): GOES_ON,
        COMPLETE, or BROKE (a token refused, or a parser limit reached: computing the mask,
        after which only stop ids are allowed, or consuming the token)."""
        if self.matcher is None:
            return GOES_ON
        if token in self.stop_ids:
            return BROKE if self.matcher.error() else GOES_ON
        if not self.matcher.consume(token):
            return BROKE
        return COMPLETE if self.matcher.is_finished() else GOES_ON

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
        if self.stop_ends is None or len(self.tokens) < self.params.min_tokens:
            self.text += piece
            return
        start = max(0, len(self.text) - self.stop_ends.longest + 1)
        self.text += piece
        found = min(((i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0), default=None)
        if found is not None:
            cut, self.stop_string = found
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
