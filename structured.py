"""Structured outputs: a generation constrained, token by token, to a JSON schema, any JSON
object, a regular expression, one of given strings or a grammar, by llguidance
(https://github.com/guidance-ai/llguidance), which walks the grammar over the tokenizer's
token trie to say which tokens may come next.

For each constrained sequence, a step: Matcher.fill_bitmask writes the sequence's row of a
bitmask (one bit per token id) on the CPU, without the GIL, so it can run while the forward
pass does (fill_bitmasks: many rows in parallel); apply_bitmask sets the logits of the
tokens it forbids to -inf; Matcher.consume takes the sampled token. A stop token is allowed
only where the grammar accepts, and once the grammar is finished nothing else is.
"""

import functools
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper, grammar_from
from llguidance.tiktoken import lltokenizer_from_encoding

import json_nesting
import schema_tightening
from tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON laid out as json.dumps does ({"a": 1, "b": [2, 3]}): free whitespace lets a model
# (or random sampling) pad an answer with line breaks until max_tokens cuts it short
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's limits (its defaults in brackets), so that no grammar holds a worker long:
# - compiling: 1M units of lexer fuel, about 20 ms [1M], a grammar of 50k symbols [500k] and
#   20k lexer states, about 40 MB [250k]: past them, a 400 naming the field;
# - each token's mask: 100k units of lexer fuel, about 7 ms [200k], and 20k Earley items
#   [50k]: a mask that needs more fails its sequence (finish_reason "error"), so that it never
#   holds the step, and the other sequences in it, longer than that (docs/api.md).
LIMITS = LLParserLimits(initial_lexer_fuel=1_000_000, max_grammar_size=50_000, max_lexer_states=20_000,
                        step_lexer_fuel=100_000, step_max_items=20_000,
                        verbose_errors=False)  # errors say what is wrong, not the parser's state
# Parsing a grammar's text comes before llguidance's limits, and grows faster than its length
# (60,000 choices: 6.5 s): regexes and grammars of at most 64 KiB (about 0.1 s), 4096 choices,
# and JSON schemas of at most 128 KiB as compact JSON (a schema of 2,700 string properties,
# about 0.7 s here; 4,000 of them, 190 KiB, took 1.7 s).
MAX_GRAMMAR_BYTES, MAX_CHOICES, MAX_SCHEMA_BYTES = 64 << 10, 4096, 128 << 10
# Compiled grammars kept for reuse, bounded in entries and in their grammars' bytes (a schema
# may be 1 MiB of text, and what it compiles to grows with it).
GRAMMAR_CACHE_ENTRIES, GRAMMAR_CACHE_BYTES = 256, 16 << 20


@dataclass(frozen=True)
class Constraint:
    """What a generation must be. kind and value:
    - json_schema: the schema (a dict, or its JSON text);
    - json_object: any JSON object (no value);
    - regex: a pattern in Rust's regex syntax, which the whole text matches;
    - choice: a list of strings, exactly one of which is the text;
    - grammar: a Lark grammar in llguidance's syntax, or a GBNF grammar (llama.cpp's)."""

    kind: str
    value: object = None


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for constraint (not compiled yet). Raises ValueError for a value
    of the wrong type or an unknown kind."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(schema_dict(value), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text_value(kind, value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError("choice: expected a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"choice: {len(value)} choices, more than the {MAX_CHOICES} this server compiles")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "grammar":
        return grammar_from("grammar", text_value(kind, value))  # GBNF is converted to Lark
    raise ValueError(f"unknown constraint kind {kind!r}: expected one of {', '.join(KINDS)}")


def schema_dict(schema) -> dict:
    """The client's schema (a JSON object, or its text) as llguidance gets it: tightened
    within what it accepts (schema_tightening). Raises ValueError saying what is wrong."""
    if isinstance(schema, str):
        try:
            schema = json_nesting.loads(schema)
        except json_nesting.TooDeep as e:
            raise ValueError(f"json_schema: {e.describe('the JSON text')}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("json_schema: expected a JSON object")
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"json_schema: {size} bytes as compact JSON, more than the {MAX_SCHEMA_BYTES} this server "
                         "compiles")
    return schema_tightening.tightened(schema)


def text_value(kind: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{kind}: expected a string")
    if len(value.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{kind}: {len(value.encode())} bytes, more than the {MAX_GRAMMAR_BYTES} this server compiles")
    return value


# --- the tokenizer as llguidance sees it -------------------------------------------------------

class Vocabulary:
    """A tokenizer's tokens in llguidance, with the model's vocabulary size: the ids past the
    tokenizer's (padding rows of the embedding) are never allowed. Make one per tokenizer with
    vocabulary(); it compiles constraints into matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        if vocab_size < tokenizer.n_words:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.n_words}")
        self.vocab_size = vocab_size
        self.ll = ll_tokenizer(tokenizer, vocab_size)

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A new sequence's matcher. Raises ValueError, saying what is wrong, for a constraint
        that does not compile."""
        return Matcher(compiled(self.ll, grammar_text(constraint)).deep_copy())


@functools.cache
def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> Vocabulary:
    return Vocabulary(tokenizer, vocab_size)  # about a second for 128k tokens: once


class GrammarCache:
    """Compiled grammars by (tokenizer, grammar text), the least recently used dropped first
    past GRAMMAR_CACHE_ENTRIES entries or GRAMMAR_CACHE_BYTES of grammar text."""

    def __init__(self, entries: int = GRAMMAR_CACHE_ENTRIES, max_bytes: int = GRAMMAR_CACHE_BYTES):
        self.entries, self.max_bytes, self.bytes, self.hits = entries, max_bytes, 0, 0
        self.kept: OrderedDict[tuple[int, str], LLMatcher] = OrderedDict()
        self.lock = threading.Lock()  # rank 0 compiles on the request thread, other ranks on the engine's

    def __call__(self, ll: LLTokenizer, grammar: str) -> LLMatcher:
        """A matcher at the start of grammar: the compiled grammar, which matchers copy."""
        key = (id(ll), grammar)
        with self.lock:
            if key in self.kept:
                self.kept.move_to_end(key)
                self.hits += 1
                return self.kept[key]
        matcher = LLMatcher(ll, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise ValueError(UNIMPLEMENTED.sub(unsupported, matcher.get_error()))
        with self.lock:
            if key not in self.kept:
                self.kept[key] = matcher
                self.bytes += len(grammar)
            while len(self.kept) > self.entries or (self.bytes > self.max_bytes and len(self.kept) > 1):
                (_, dropped), _ = self.kept.popitem(last=False)
                self.bytes -= len(dropped)
        return matcher


compiled = GrammarCache()


UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")  # llguidance's words for the keywords it lacks


def unsupported(found: re.Match) -> str:
    keywords = json.loads(found.group(1))
    return f"unsupported keyword{'s' * (len(keywords) > 1)}: {', '.join(keywords)}"


# llguidance's slices: tokens are split among these regexes (each to the first that matches it,
# the rest to a catch-all), and a mask skips the tokens of any slice the lexer allows whole,
# walking the token trie only for the others. Its defaults (general_slices(): whitespace, then
# string characters {1,10}, {1,30}, +) skip nothing inside an email (format) or a string with
# fewer than 10 characters left of its maxLength; alphanumeric slices (which an email's parts
# allow whole) and a {1,5} one cut those walks. Only how fast a mask is computed, never what it
# allows: BENCHMARKS.md, "Structured outputs".
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
SLICES = [r"[\x20\x0A\x0D\x09]+", "[a-zA-Z0-9]{1,10}", "[a-zA-Z0-9]{1,30}", "[a-zA-Z0-9]+",
          _STRING_CHAR + "{1,5}", _STRING_CHAR + "{1,10}", _STRING_CHAR + "{1,30}", _STRING_CHAR + "+"]


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's tokenizer for ours, with SLICES. The tiktoken and Hugging Face ones are
    llguidance's own (Rust, so computing a mask never needs the GIL, and text it forces is
    tokenized as the tokenizer would)."""
    stops = sorted(tokenizer.stop_ids) or None
    if isinstance(tokenizer, HFTokenizer):  # its JSON: a GGUF file's tokenizer has no tokenizer.json
        return LLTokenizer(tokenizer.model.to_str(), n_vocab=vocab_size, eos_token=stops, slices=SLICES)
    if isinstance(tokenizer, TiktokenTokenizer):
        return lltokenizer_from_encoding(tokenizer.model, n_vocab=vocab_size, eos_token=stops).with_slices(SLICES)
    table = SentencePieceTable(tokenizer, vocab_size)
    ll = LLTokenizer(TokenizerWrapper(table), eos_token=stops, slices=SLICES)
    table.tokenize = ll.greedy_tokenize
    return ll


class SentencePieceTable:
    """What llguidance's TokenizerWrapper reads of a sentencepiece tokenizer: each id's bytes
    (none for padding ids, which llguidance then never allows), which ids are special, eos,
    bos, and a tokenize function for text the grammar forces. sentencepiece's own encoding
    starts with a space that the text does not have, so that text is cut greedily into the
    longest tokens instead (by llguidance's trie, once it is built)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        sp = tokenizer.sp_model
        n = tokenizer.n_words
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        self.special_token_ids = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)]
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
        self.tokenize = None

    def __call__(self, text: str) -> list[int]:
        return self.tokenize(text)


# --- one sequence ------------------------------------------------------------------------------

class Matcher:
    """Where one sequence is in its grammar."""

    def __init__(self, ll: LLMatcher):
        self.ll = ll

    def fill_bitmask(self, bitmask: torch.Tensor, row: int):
        """Writes the tokens allowed next into bitmask[row] (bit b of word w: token 32w + b),
        without holding the GIL. bitmask: from new_bitmask."""
        check_bitmask(bitmask)
        self.ll.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)

    def consume(self, token: int) -> bool:
        """Moves past the sampled token; False if the grammar forbids it, after which only stop
        tokens are allowed (error() says why)."""
        return self.ll.consume_token(token)

    def is_accepting(self) -> bool:
        """The text so far is complete: a stop token may end it here."""
        return self.ll.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but a stop token may follow (the grammar is complete, or broken)."""
        return self.ll.is_stopped()

    def error(self) -> str:
        """Why the grammar broke ('' while it is not): a forbidden token, or too complex a step."""
        return self.ll.get_error()

    def rollback(self, n: int):
        """Forgets the last n tokens consumed (draft tokens that were rejected)."""
        if not self.ll.rollback(n):
            raise RuntimeError(f"cannot roll back {n} tokens: {self.ll.get_error()}")


# --- bitmasks and logits -----------------------------------------------------------------------

def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask (rows, words) with every token allowed: the rows of unconstrained sequences
    stay so."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def check_bitmask(bitmask: torch.Tensor):
    # llguidance writes through the pointer: anything but a contiguous CPU int32 tensor is memory corruption
    cpu_int32 = bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    if not cpu_int32 or not bitmask.is_contiguous() or bitmask.dim() != 2:
        raise ValueError("a bitmask is a contiguous 2-D int32 tensor on the CPU (new_bitmask)")


@functools.cache
def executor() -> LLExecutor:
    return LLExecutor()  # threads: 80% of the cores, at most 32


def fill_bitmasks(bitmask: torch.Tensor, rows: list[tuple[Matcher, int]]):
    """Matcher.fill_bitmask for each (matcher, row), in parallel on llguidance's threads."""
    check_bitmask(bitmask)
    if rows:
        executor().unsafe_compute_mask_ptr([(m.ll, row) for m, row in rows], bitmask.data_ptr(),
                                           bitmask.shape[1] * 4, bitmask.shape[0])


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor):
    """logits (rows, vocab), on any device, set to -inf in place where bitmask's bit is 0."""
    rows, vocab = logits.shape
    if bitmask.shape != (rows, (vocab + 31) // 32):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit logits {tuple(logits.shape)}")
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = (bitmask.to(logits.device, non_blocking=True).unsqueeze(-1) >> bits) & 1
    logits.masked_fill_(allowed.flatten(1)[:, :vocab] == 0, float("-inf"))
