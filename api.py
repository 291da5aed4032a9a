"""What the APIs (native, OpenAI's, Anthropic's) share: the Request a body is parsed into, the
validators of its fields, turning a Request into prompts with sampling settings
(sequences), and what serving.py asks of an API's answers (Format, Message). Every problem
is a RequestError that names the field; it goes out as a 4xx."""

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Protocol, runtime_checkable

import chat_format
import json_nesting
from sequence import SamplingParams, Sequence


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass
class Limits:
    max_new_tokens: int = 512  # cap on max_new_tokens (max_tokens in the OpenAI API)
    max_prompt_tokens: int = 0  # 0: whatever max_seq_len leaves room for
    max_prompts: int = 8  # prompts in one request (each takes a KV-cache slot)
    max_messages: int = 64  # messages in one dialog
    max_body_bytes: int = 1 << 20


@dataclass
class Defaults:
    max_new_tokens: int = 64
    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0


def dataclass_from(cls, values: dict | None, where: str):
    """cls(**values) for a config section, refusing unknown keys by name."""
    values = values or {}
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return cls(**values)


@dataclass
class Request:
    api: str  # "native", "completions", "chat", "responses" or "messages"
    chat: bool = False
    input_field: str = "prompt"  # the field the inputs came in: prompt, dialog or messages
    inputs: list = field(default_factory=list)  # prompt strings or token-id lists, or dialogs
    texts: list = field(default_factory=list)  # each text input's prompt as text (echo gives it back)
    n: int = 1  # sequences (choices) per input; sequence k answers input k // n
    batched: bool = False  # a list of prompts (or n > 1) came in: a list of answers goes out
    stream: bool = False
    max_new_tokens: int | None = None  # None: the default, cut to what the context leaves
    sampling: dict = field(default_factory=dict)  # SamplingParams fields but max_gen_len
    include_usage: bool = False  # OpenAI stream_options.include_usage
    tools: list = field(default_factory=list)  # chat: the function tools the model may call (tool_calls.py)
    # (constraint, what is wrong if it does not compile, its field): compiled after every cheap check
    to_compile: list = field(default_factory=list)
    tool_streams: dict = field(default_factory=dict)  # a streamed chat with tools: each choice's ToolCallStream
    state: dict = field(default_factory=dict)  # an API's own: fields its answer repeats, its stream's progress


@dataclass
class Job:
    """One request in flight."""
    req_id: str  # TorchServe's
    request: Request
    http: bool  # HTTP (not gRPC): a one-message answer must not carry the stream header
    prompts: list[tuple[list[int], SamplingParams]]
    meta: dict  # id, created and model, for OpenAI's answers
    seqs: list[Sequence] = field(default_factory=list)
    error: RequestError | None = None
    started: bool = False  # a streamed chunk went out
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the JSON escape of a UTF-16 surrogate


def read_body(raw, limits: Limits):
    """The JSON value of a request body as TorchServe hands it over: bytes (the handler turns
    TorchServe's JSON decoding off, so that the size limit and strict parsing see every
    body), a str, or a JSON value TorchServe decoded already. Nested deeper than
    json_nesting.MAX_DEPTH, it is refused, naming where."""
    if raw is not None and not isinstance(raw, (str, bytes, bytearray)):
        return check_text(checked_nesting(json_nesting.check, raw))
    if raw is None or len(raw) == 0:
        raise RequestError("the request body is empty; send a JSON object", "body")
    if len(raw) > limits.max_body_bytes:
        raise RequestError(f"the request body has {len(raw)} bytes, the limit is {limits.max_body_bytes}",
                           "body", status=413)
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"the request body is not valid UTF-8: byte 0x{e.object[e.start]:02x} at offset "
                               f"{e.start}", "body") from None
    try:
        value = checked_nesting(json_nesting.loads, raw, parse_constant=reject_constant)
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                           "body") from None
    except NotANumber as e:
        raise RequestError(f"the request body is not valid JSON: {e}", "body") from None
    except ValueError:  # what else json.loads raises: Python's limit on the digits of an integer
        raise RequestError(f"the request body is not valid JSON for this server: it has an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits", "body") from None
    # valid UTF-8 holds no surrogates: only a \ud800-\udfff escape makes one (check_text
    # re-encodes the whole value: 0.1 s a MiB)
    return check_text(value) if SURROGATE_ESCAPE.search(raw) else value


def checked_nesting(read, value, **options):
    """read(value, **options) (json_nesting's check or loads), its TooDeep a RequestError
    naming the top-level field it is in."""
    try:
        return read(value, **options)
    except json_nesting.TooDeep as e:
        field = e.path[0] if e.path and isinstance(e.path[0], str) else "body"
        raise RequestError(e.describe("the request body"), field) from None


def check_text(value, where: str = "the request body", param: str = "body"):
    """value, unless a string in it holds a lone surrogate (an unpaired \\ud800-\\udfff escape):
    that is not text, and the tokenizer cannot encode it."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{where} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                           "which is not text", param) from None
    return value


class NotANumber(ValueError):
    pass


def reject_constant(name):
    raise NotANumber(f"{name} is not a JSON number")


# --- field validators: each returns the value or raises RequestError naming the field ----

def check_model(body: dict, model_name: str, required: bool = False):
    """model, where given (or required), must name the model served: else a 404."""
    model = body.get("model")
    if model is None and required:
        raise RequestError("model is required", "model")
    if model is not None and model != model_name:
        raise RequestError(f"The model `{model}` does not exist; this server serves `{model_name}`", "model", 404)


def check_fields(body: dict, known: set, neutral: dict):
    """body's keys are known ones, or others at a neutral value (null, or one of neutral's):
    any other is refused by name rather than ignored."""
    for name, value in body.items():
        if name in known or value is None:
            continue
        if name not in neutral:
            raise RequestError(f"unknown field {name!r}; accepted: {', '.join(sorted(known | set(neutral)))}",
                               str(name))
        if value not in neutral[name]:
            raise RequestError(f"{name}={json.dumps(value)} is not supported (only {json.dumps(neutral[name][0])})",
                               name)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {type_name(value)}", name)
    return value


def get_int(body: dict, name: str, lo: int, hi: int, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {type_name(value)}", name)
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def get_number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {type_name(value)}", name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise RequestError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name)
    return float(value)


MAX_STOP_CHARS = 512  # per stop string: the stop strings OpenAI and vLLM users send are short


def get_stop(body: dict, name: str = "stop", max_count: int = 16) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"{name} must be a non-empty string or a list of them", name)
    if len(stops) > max_count:
        raise RequestError(f"{name} may hold at most {max_count} strings, got {len(stops)}", name)
    long = [i for i, stop in enumerate(stops) if len(stop) > MAX_STOP_CHARS]
    if long:
        raise RequestError(f"{name} strings may have at most {MAX_STOP_CHARS} characters; "
                           f"{', '.join(f'{name}[{i}] has {len(stops[i])}' for i in long)}", name)
    return tuple(stops)


def get_prompts(body: dict, name: str, limits: Limits, token_ids: bool = False) -> tuple[list, bool]:
    """(prompts, batched) from a string or a non-empty list of strings; with token_ids, also
    from a list of token ids or a list of such lists (OpenAI's completions)."""
    value = body[name]
    if isinstance(value, str) or (token_ids and is_id_list(value) and value):
        return [value], False
    kinds = "strings or of token-id lists" if token_ids else "strings"
    if not isinstance(value, list) or not value:
        raise RequestError(f"{name} must be a string or a non-empty list of {kinds}", name)
    for i, p in enumerate(value):
        if not (isinstance(p, str) or (token_ids and is_id_list(p))):
            raise RequestError(f"{name}[{i}] must be a string{' or a list of token ids' if token_ids else ''}, "
                               f"got {type_name(p)}", f"{name}[{i}]")
        if isinstance(p, list) and not p:
            raise RequestError(f"{name}[{i}] is an empty list of token ids", f"{name}[{i}]")
    if len(value) > limits.max_prompts:
        raise RequestError(f"{name} holds {len(value)} prompts, the limit is {limits.max_prompts}", name)
    return value, True


def is_id_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def get_token_ids(body: dict, name: str, max_count: int) -> tuple[int, ...]:
    """A list of token ids (checked against the vocabulary in check_token_ids)."""
    value = body.get(name)
    if value is None:
        return ()
    if not is_id_list(value):
        raise RequestError(f"{name} must be a list of token ids (integers)", name)
    if len(value) > max_count:
        raise RequestError(f"{name} may hold at most {max_count} ids, got {len(value)}", name)
    return tuple(value)


def get_logit_bias(body: dict, name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias from -100 to 100}. An error names every bad key
    and value, so that one answer tells all there is to fix."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be an object mapping token ids to biases, got {type_name(value)}", name)
    bad_keys = [repr(key) for key in value if not is_token_key(key)]
    bad_values = [f"{shown(b)} for {key!r}" for key, b in value.items() if not is_bias(b)]
    problems = []
    if bad_keys:
        problems.append(f"keys must be token ids (strings of digits), got {', '.join(bad_keys)}")
    if bad_values:
        problems.append(f"values must be numbers from -100 to 100, got {', '.join(bad_values)}")
    if problems:
        raise RequestError(f"{name} {'; '.join(problems)}", name)
    return {int(key): float(b) for key, b in value.items()}


def is_token_key(key) -> bool:
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_bias(value) -> bool:
    return is_number(value) and math.isfinite(value) and -100 <= value <= 100


def shown(value) -> str:
    """A bad value in an error: a number as it is, anything else by its type."""
    return str(value) if is_number(value) else type_name(value)


def get_dialog(body: dict, name: str, limits: Limits) -> list:
    dialog = body[name]
    if isinstance(dialog, list) and len(dialog) > limits.max_messages:
        raise RequestError(f"{name} holds {len(dialog)} messages, the limit is {limits.max_messages}", name)
    try:
        chat_format.check_messages(dialog)
    except ValueError as e:
        raise RequestError(str(e).replace("dialog", name), name) from None
    return dialog


def kind_of(value, default: str | None = None) -> str | None:
    """The "type" of a typed object (an input item, a content block, a tool choice): a string,
    or None for anything else (a list there must be refused, not looked up)."""
    kind = value.get("type", default) if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


def type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


# --- shared by both APIs -----------------------------------------------------------------

MAX_TOP_LOGPROBS = 20


def get_n(body: dict, inputs: int, limits: Limits) -> int:
    """n: sequences per input, each in its own KV-cache slot."""
    n = get_int(body, "n", 1, limits.max_prompts, 1)
    if n * inputs > limits.max_prompts:
        raise RequestError(f"n={n} for {inputs} prompts makes {n * inputs} sequences, the limit is "
                           f"{limits.max_prompts}", "n")
    return n


def get_top_logprobs(body: dict, logprobs: bool, needs: str) -> int:
    top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if top and not logprobs:
        raise RequestError(f"top_logprobs needs {needs}", "top_logprobs")
    return top


MIN_TEMPERATURE = 1e-5  # below it, greedy: logits / temperature would overflow float32 into NaN


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "speculative")


def sampling_fields(body: dict, defaults: Defaults, top_p: str) -> dict:
    """temperature, top_p, top_k, seed, stop, penalties, logit_bias, min_tokens,
    stop_token_ids, ignore_eos and speculative (false: no speculative decoding for it),
    validated, with defaults filled in."""
    temperature = get_number(body, "temperature", 0.0, 2.0, defaults.temperature)
    return {"temperature": temperature if temperature >= MIN_TEMPERATURE else 0.0,
            "top_p": get_number(body, top_p, 0.0, 1.0, defaults.top_p, lo_open=True),
            "top_k": get_int(body, "top_k", 0, 1 << 31, defaults.top_k),
            "seed": get_int(body, "seed", 0, (1 << 63) - 1),
            "stop": get_stop(body),
            "presence_penalty": get_number(body, "presence_penalty", -2.0, 2.0, 0.0),
            "frequency_penalty": get_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
            "repetition_penalty": get_number(body, "repetition_penalty", 0.0, 2.0, 1.0, lo_open=True),
            "logit_bias": get_logit_bias(body),
            "min_tokens": get_int(body, "min_tokens", 0, 1 << 31, 0),
            "stop_token_ids": get_token_ids(body, "stop_token_ids", 64),
            "ignore_eos": get_bool(body, "ignore_eos"),
            "speculative": get_bool(body, "speculative", True)}


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a request's choice-th sequence: the request's for the first, others
    derived from it (so that n sequences differ and each is reproducible)."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice * 0x9E3779B97F4A7C15) % (1 << 63)


def check_token_ids(ids, n_words: int, param: str):
    """Every id in the vocabulary; an error names each one that is not (once)."""
    bad = [str(t) for t in dict.fromkeys(ids) if not 0 <= t < n_words]
    if bad:
        raise RequestError(f"{param} holds token id{'s' * (len(bad) > 1)} {', '.join(bad)}; the vocabulary has "
                           f"ids 0 to {n_words - 1}", param)


def sequences(req: Request, tokenizer, max_seq_len: int, limits: Limits,
              defaults: Defaults) -> list[tuple[list[int], SamplingParams]]:
    """Each sequence's prompt tokens and sampling settings (n per input), checked against
    the context and the vocabulary. Fills req.texts."""
    out = []
    param = req.input_field
    max_param = "max_new_tokens" if req.api == "native" else "max_tokens"
    prompt_limit = min(limits.max_prompt_tokens or max_seq_len - 1, max_seq_len - 1)
    for name in ("stop_token_ids", "logit_bias"):
        check_token_ids(req.sampling.get(name, ()), tokenizer.n_words, name)
    for i, item in enumerate(req.inputs):
        where = param if len(req.inputs) == 1 or req.chat else f"{param}[{i}]"
        check_text(item, where, where)
        try:
            if req.chat:
                tokens = chat_format.encode_dialog(tokenizer, item, req.tools or None)
            elif isinstance(item, list):  # token ids, as they are
                check_token_ids(item, tokenizer.n_words, where)
                tokens = item
            else:
                tokens = tokenizer.encode(item, bos=True, eos=False)
        except ValueError as e:  # a rule of the chat format
            raise RequestError(str(e).replace("dialog", param), param) from None
        if not req.chat:
            req.texts.append(tokenizer.decode(item) if isinstance(item, list) else item)
        if len(tokens) > prompt_limit:
            raise RequestError(f"{where} has {len(tokens)} tokens, the limit is {prompt_limit}", where)
        room = max_seq_len - len(tokens)
        new = req.max_new_tokens
        if new is None:
            new = min(defaults.max_new_tokens, room, limits.max_new_tokens)
        elif new > room:
            raise RequestError(f"{where} has {len(tokens)} tokens and {new} new tokens were asked for; the "
                               f"context holds {max_seq_len}, so at most {room} new tokens fit", max_param)
        if req.sampling.get("min_tokens", 0) > new:
            raise RequestError(f"min_tokens {req.sampling['min_tokens']} is more than the {new} new tokens of "
                               f"{where}", "min_tokens")
        sampling = dict(req.sampling)
        for choice in range(req.n):
            sampling["seed"] = choice_seed(req.sampling.get("seed"), choice)
            out.append((tokens, SamplingParams(max_gen_len=new, continue_prompt=not req.chat, **sampling)))
    return out


# --- answers: what the handler asks of an API's format -----------------------------------

class Message(NamedTuple):
    """One message to a request: the whole answer ("once"), a streamed chunk with more to
    come ("chunk"), or a stream's last one ("last")."""
    body: str
    status: int
    content_type: str
    kind: str


@runtime_checkable
class Format(Protocol):
    """An API's answers, by module: native_api, openai_api, responses_api and messages_api
    implement it. error_tail ends a stream that began: req and meta are its request's.
    CHOICE_ERRORS: whether a choice may end with finish_reason "error" (its grammar broke);
    in an API without, the request fails (error, error_tail)."""
    STREAM_TYPE: str
    CHOICE_ERRORS: bool

    def answer(self, req: Request, seqs: list[Sequence], tokenizer, meta: dict) -> dict | list: ...

    def chunk(self, req: Request, meta: dict, index: int, text: str, first: bool) -> str: ...

    def last_chunks(self, req: Request, seqs: list[Sequence], meta: dict, tokenizer) -> str: ...

    def error(self, err: RequestError) -> dict: ...

    def error_tail(self, err: RequestError, req: Request, meta: dict) -> str: ...
