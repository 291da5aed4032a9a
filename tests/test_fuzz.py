"""Property-based fuzzing of request parsing and validation, in this process: whatever bytes
or JSON value come in, api.read_body, native_api.parse, openai_api.parse, responses_api.parse,
messages_api.parse (and count_tokens) and api.sequences (with the demo tokenizer) give either a
valid request whose prompts fit the context and the limits, or an api.RequestError with a 4xx
status; never any other exception."""

import json

import pytest
from hypothesis import HealthCheck, example, find, given, settings
from hypothesis import strategies as st

import api
import chat_format
import messages_api
import native_api
import openai_api
import responses_api
from api import Defaults, Limits, RequestError
from conftest import TOKENIZER
from tokenizer import Tokenizer

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# (limits, max_seq_len): the defaults of model-config.yaml, and small ones that long inputs cross
CONTEXTS = [(Limits(), 512),
            (Limits(max_new_tokens=16, max_prompt_tokens=24, max_prompts=3, max_messages=5, max_body_bytes=2048), 48)]
DEFAULTS = Defaults()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(TOKENIZER)


# --- strategies ----------------------------------------------------------------------------

# text; now and then with lone surrogates (JSON's "\ud800" escapes decode to them) or chat tags
text = st.one_of(st.text(max_size=30), st.text(st.sampled_from("abc xyz.\n"), max_size=30),
                 st.lists(st.one_of(st.characters(), st.characters(categories=["Cs"]),
                                    st.sampled_from(["[INST]", "<<SYS>>", "[/INST]"])), max_size=10).map("".join))
numbers = st.one_of(st.integers(-10, 1000), st.integers(), st.integers(-(1 << 70), 1 << 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.just(1e-300), st.just(5e-324))
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(text, inner, max_size=4)),
                           max_leaves=12)


def mostly(valid, invalid=json_values):
    """valid values about two times in three."""
    return st.one_of(valid, valid, invalid)


roles = mostly(st.sampled_from(["system", "user", "assistant"]),
               st.one_of(st.sampled_from(["robot", "usér", "USER", "", "user\u0000", "ユーザー", "\U0001F600"]),
                         text, json_values))
parts = st.lists(mostly(st.fixed_dictionaries({"type": st.just("text"), "text": text})), max_size=3)
message = mostly(st.fixed_dictionaries({"role": roles, "content": mostly(text, st.one_of(parts, json_values))}))
# dialogs that follow the rules often enough to reach the tokenizer and the length checks
good_dialog = st.builds(lambda system, turns: ([{"role": "system", "content": system}] if system else [])
                        + [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                           for i, t in enumerate(turns)],
                        st.one_of(st.none(), text), st.lists(text, min_size=1, max_size=9).filter(lambda t: len(t) % 2))
dialogs = mostly(good_dialog, st.one_of(st.lists(message, max_size=8), json_values))
prompts = mostly(st.one_of(text, st.text(st.sampled_from("abc xyz."), max_size=400),
                           st.lists(text, min_size=1, max_size=10)))
counts = mostly(st.integers(1, 40), st.one_of(st.integers(-2, 0), st.integers(0, 1 << 20), numbers, json_values))
temperatures = mostly(st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2, 1e-6, 1e-45, 5e-324])),
                      st.one_of(st.floats(-1e9, -1e-9), st.floats(2.0001, 1e9), numbers, json_values))
top_ps = mostly(st.floats(1e-9, 1), st.one_of(st.just(0), st.floats(-1, 0), st.floats(1.0001, 10), numbers))
top_ks = mostly(st.integers(0, 100), st.one_of(st.integers(max_value=-1), numbers, json_values))
seeds = mostly(st.integers(0, (1 << 63) - 1), st.one_of(st.integers(max_value=-1), st.integers(min_value=1 << 63),
                                                        numbers, json_values))
flags = mostly(st.booleans())
stops = mostly(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
               st.one_of(st.just(""), st.lists(text, max_size=20), json_values))
def often(valid, invalid):
    """valid values about four times in five: for the many optional sampling fields, so that
    bodies with several of them still pass now and then."""
    return st.one_of(valid, valid, valid, valid, invalid)


# token ids: mostly in the demo vocabulary (4096), sometimes past it or negative
token_ids = st.one_of(st.integers(0, 4095), st.integers(0, 4095), st.integers(-3, 1 << 40))
id_lists = often(st.lists(token_ids, max_size=6), st.one_of(st.lists(st.one_of(token_ids, json_values), max_size=4),
                                                            st.lists(token_ids, min_size=65, max_size=70)))
penalties = often(st.floats(-2, 2), st.one_of(st.floats(2.0001, 1e9), st.floats(-1e9, -2.0001), numbers, json_values))
repetition = often(st.floats(1e-6, 2), st.one_of(st.just(0), st.floats(-5, 0), st.floats(2.0001, 100), numbers))
logit_bias = often(st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=4),
                   st.one_of(st.dictionaries(st.one_of(text, st.integers(-5, 1 << 40).map(str)),
                                             st.one_of(numbers, json_values), max_size=3), json_values))
# valid values of the fields below are mostly small: the more fields a body has, the fewer
# bodies pass every check, and each property needs accepted requests too
choices = often(st.integers(1, 2), st.one_of(st.integers(-1, 0), st.integers(3, 100), numbers, json_values))
min_tokens = often(st.integers(0, 4), st.one_of(st.integers(max_value=-1), st.integers(5, 1 << 20), numbers))
top_logprobs = often(st.one_of(st.just(0), st.integers(0, 20)),
                     st.one_of(st.integers(-2, -1), st.integers(21, 100), numbers, json_values))

COMMON = {"temperature": temperatures, "top_p": top_ps, "top_k": top_ks, "seed": seeds, "stop": stops,
          "stream": flags, "n": choices, "presence_penalty": penalties, "frequency_penalty": penalties,
          "repetition_penalty": repetition, "logit_bias": logit_bias, "min_tokens": min_tokens,
          "stop_token_ids": id_lists, "ignore_eos": flags, "top_logprobs": top_logprobs}
NATIVE = COMMON | {"prompt": prompts, "dialog": dialogs, "messages": dialogs, "max_new_tokens": counts,
                   "logprobs": flags, "echo": flags}
OPENAI = COMMON | {"model": mostly(st.just("llama"), st.one_of(text, json_values)),
                   "max_tokens": st.one_of(counts, st.just(0)), "max_completion_tokens": counts,
                   "logprobs": mostly(st.one_of(st.integers(0, 20), flags), st.integers(-1, 25)), "echo": flags,
                   "user": st.one_of(text, json_values),
                   "stream_options": mostly(st.fixed_dictionaries({"include_usage": flags}))} \
    | {name: mostly(st.sampled_from(allowed)) for name, allowed in openai_api.NEUTRAL.items()}
# OpenAI's completions also take token ids: a list of them, or a list of such lists
completion_prompts = st.one_of(prompts, id_lists, st.lists(id_lists, min_size=1, max_size=5))

# OpenAI's Responses API and Anthropic's Messages API: their items, blocks and tools
SAMPLING = {name: COMMON[name] for name in api.SAMPLING_FIELDS if name in COMMON}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
arguments = mostly(st.builds(lambda city: json.dumps({"city": city}), text), text)
response_parts = st.lists(mostly(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]),
                                                        "text": text})), max_size=3)
response_items = st.one_of(
    mostly(st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "developer", "assistant"]), roles),
                                  "content": mostly(text, response_parts)})),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": mostly(st.just("call_1"), text),
                           "name": mostly(st.just("get_weather"), text), "arguments": arguments}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": mostly(st.just("call_1"), text),
                           "output": mostly(text, response_parts)}))
responses_tools = mostly(st.just([{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]),
                         st.lists(st.dictionaries(st.sampled_from(["type", "name", "parameters", "strict"]),
                                                  json_values), max_size=2))
RESPONSES = SAMPLING | {
    "model": mostly(st.just("llama"), st.one_of(text, json_values)), "max_output_tokens": counts,
    "input": mostly(st.one_of(text, st.lists(response_items, min_size=1, max_size=5))),
    "instructions": mostly(text), "tools": responses_tools,
    "tool_choice": mostly(st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}])),
    "text": mostly(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                    {"format": {"type": "json_schema", "name": "c", "schema": CITY}}])),
    "store": mostly(st.just(False)), "include": mostly(st.just([])), "metadata": mostly(st.just({"a": "b"})),
    "user": mostly(text), "parallel_tool_calls": flags}
user_blocks = st.lists(mostly(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": mostly(st.just("toolu_1"), text),
                           "content": mostly(text, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                  "text": text}), max_size=2)),
                           "is_error": flags}))), min_size=1, max_size=3)
assistant_blocks = st.lists(mostly(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": mostly(st.just("toolu_1"), text),
                           "name": mostly(st.just("get_weather"), text),
                           "input": mostly(st.builds(lambda city: {"city": city}, text))}))), min_size=1, max_size=3)
anthropic_dialogs = mostly(st.builds(
    lambda turns: [{"role": "user" if i % 2 == 0 else "assistant", "content": content}
                   for i, content in enumerate(turns)],
    st.lists(st.tuples(mostly(text, user_blocks), mostly(text, assistant_blocks)), min_size=1, max_size=3)
    .flatmap(lambda pairs: st.just([c for pair in pairs for c in pair][:-1]))),
    st.one_of(st.lists(message, max_size=4), json_values))
MESSAGES = SAMPLING | {
    "model": mostly(st.just("llama"), st.one_of(text, json_values)), "max_tokens": counts,
    "messages": anthropic_dialogs, "system": mostly(text, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": text}), max_size=2)),
    "stop_sequences": stops,
    "tools": mostly(st.just([{"name": "get_weather", "input_schema": CITY}]),
                    st.lists(st.dictionaries(st.sampled_from(["type", "name", "input_schema"]), json_values),
                             max_size=2)),
    "tool_choice": mostly(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                           {"type": "tool", "name": "get_weather"}])),
    "output_config": mostly(st.just({"format": {"type": "json_schema", "schema": CITY}})),
    "metadata": mostly(st.just({"user_id": "u"}))}
MESSAGES.pop("stop")  # Anthropic's is stop_sequences


def request_bodies(fields: dict, required: list[str]):
    """Objects with one of the required fields (mostly) and any of the others, plus unknown
    keys now and then, and arbitrary JSON values."""
    def build(draw):
        body = {}
        if draw(st.integers(0, 9)):  # mostly one of prompt / dialog / messages
            name = draw(st.sampled_from(required))
            body[name] = draw(fields[name])
        for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
            body[name] = draw(fields[name])
        if not draw(st.integers(0, 9)):
            body[draw(text)] = draw(json_values)
        return body
    return st.one_of(st.composite(lambda draw: build(draw))(), json_values)


native_bodies = request_bodies(NATIVE, ["prompt", "dialog", "messages"])
completion_bodies = request_bodies(OPENAI | {"prompt": completion_prompts}, ["prompt"])
chat_bodies = request_bodies(OPENAI | {"messages": dialogs}, ["messages"])


def with_required(bodies, required: dict):
    """bodies, mostly with the required fields too (Anthropic's model and max_tokens)."""
    return st.builds(lambda base, body: base | body if isinstance(body, dict) else body,
                     st.one_of(st.fixed_dictionaries(required), st.fixed_dictionaries(required), st.just({})), bodies)


responses_bodies = request_bodies(RESPONSES, ["input"])
messages_bodies = with_required(request_bodies(MESSAGES, ["messages"]),
                                {"model": st.just("llama"), "max_tokens": st.integers(1, 40)})
count_bodies = with_required(request_bodies({k: v for k, v in MESSAGES.items() if k in messages_api.COUNT_FIELDS},
                                            ["messages"]), {"model": st.just("llama")})
BODIES = {"native": native_bodies, "completions": completion_bodies, "chat": chat_bodies,
          "responses": responses_bodies, "messages": messages_bodies, "count_tokens": count_bodies}


def serialized(draw_body):
    """Bytes of a body: JSON (with NaN and surrogate escapes where the value has them), maybe
    cut, with a byte spliced in, or wrapped."""
    return st.tuples(draw_body, st.integers(0, 5), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=3)) \
        .map(lambda t: mutate(json.dumps(t[0]).encode(), *t[1:]))


def mutate(raw: bytes, how: int, at: int, junk: bytes) -> bytes:
    at = at % (len(raw) + 1)
    return [raw, raw, raw[:at], raw[:at] + junk + raw[at:], b"[" + raw + b"]", b"\xef\xbb\xbf" + raw][how]


# --- checks --------------------------------------------------------------------------------

def refused(e: RequestError):
    """A refusal must be a 4xx that both APIs can send as JSON."""
    assert isinstance(e, RequestError)
    assert 400 <= e.status < 500, (e.status, e.message)
    assert isinstance(e.message, str) and e.message and (e.param is None or isinstance(e.param, str))
    for fmt in (native_api, openai_api, responses_api, messages_api):
        json.dumps(fmt.error(e)).encode("utf-8")


def accepted(req: api.Request, prepared, tokenizer, limits: Limits, max_seq_len: int):
    """What a request that passed must satisfy: what the engine accepts without a check failing."""
    assert 1 <= len(req.inputs) * req.n == len(prepared) <= limits.max_prompts
    assert req.batched or len(req.inputs) == 1
    assert req.api != "native" or req.batched or len(prepared) == 1  # native: n > 1 answers with a list
    assert isinstance(req.stream, bool) and isinstance(req.include_usage, bool)
    prompt_limit = min(limits.max_prompt_tokens or max_seq_len - 1, max_seq_len - 1)
    for k, (tokens, params) in enumerate(prepared):
        item = req.inputs[k // req.n]
        if req.chat:
            assert chat_format.validate_llama2(item) and len(item) <= limits.max_messages
            assert tokens == chat_format.encode_dialog(tokenizer, item, req.tools or None)
        elif isinstance(item, list):
            assert tokens == item and all(0 <= t < tokenizer.n_words for t in tokens)
        else:
            assert tokens == tokenizer.encode(item, bos=True, eos=False)
        assert 1 <= len(tokens) <= prompt_limit
        assert (0 if params.echo else 1) <= params.max_gen_len <= limits.max_new_tokens
        assert len(tokens) + params.max_gen_len <= max_seq_len
        assert 0 <= params.min_tokens <= params.max_gen_len
        assert type(params.presence_penalty) is float and -2 <= params.presence_penalty <= 2
        assert type(params.frequency_penalty) is float and -2 <= params.frequency_penalty <= 2
        assert type(params.repetition_penalty) is float and 0 < params.repetition_penalty <= 2
        assert all(0 <= t < tokenizer.n_words and type(b) is float and -100 <= b <= 100
                   for t, b in params.logit_bias.items())
        assert all(0 <= t < tokenizer.n_words for t in params.stop_token_ids)
        assert type(params.ignore_eos) is bool
        assert 0 <= params.top_logprobs <= 20 and (params.logprobs or not params.top_logprobs)
        assert type(params.temperature) is float and (params.temperature == 0
                                                       or api.MIN_TEMPERATURE <= params.temperature <= 2)
        assert type(params.top_p) is float and 0 < params.top_p <= 1
        assert type(params.top_k) is int and params.top_k >= 0
        assert params.seed is None or (type(params.seed) is int and 0 <= params.seed < 1 << 63)
        assert isinstance(params.stop, tuple) and all(isinstance(s, str) and s for s in params.stop)
        assert type(params.logprobs) is bool and type(params.echo) is bool
        assert not (req.chat and params.echo)


def parse(route: str, body, limits: Limits) -> api.Request:
    if route == "native":
        return native_api.parse(body, limits, DEFAULTS)
    if route in ("responses", "messages"):
        return {"responses": responses_api, "messages": messages_api}[route].parse(body, "llama", limits, DEFAULTS)
    return openai_api.parse(route, body, "llama", limits, DEFAULTS)


def run(route: str, body, tokenizer, limits: Limits, max_seq_len: int):
    """The handler's path from a JSON value to prompts; checks whichever way it ends."""
    try:
        if route == "count_tokens":
            counted = messages_api.count_tokens(body, tokenizer, "llama", limits)
            assert set(counted) == {"input_tokens"} and counted["input_tokens"] >= 1
            return counted
        req = parse(route, body, limits)
        prepared = api.sequences(req, tokenizer, max_seq_len, limits, DEFAULTS)
    except RequestError as e:
        refused(e)
        return None
    accepted(req, prepared, tokenizer, limits, max_seq_len)
    return req


# --- the properties ------------------------------------------------------------------------

@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), serialized(native_bodies), serialized(chat_bodies)),
       context=st.sampled_from(CONTEXTS))
@example(raw=b"", context=CONTEXTS[0])
@example(raw=b"[" * 100_000, context=CONTEXTS[0])
@example(raw=b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", context=CONTEXTS[0])
@example(raw=b'{"prompt": "a\\ud800"}', context=CONTEXTS[0])
@example(raw=b'{"temperature": NaN}', context=CONTEXTS[0])
@example(raw=b"\xff\xfe{}", context=CONTEXTS[0])
@example(raw=b"x" * 3000, context=CONTEXTS[1])
def test_read_body_any_bytes(raw, context):
    limits = context[0]
    try:
        value = api.read_body(raw, limits)
    except RequestError as e:
        refused(e)
        return
    assert 0 < len(raw) <= limits.max_body_bytes
    assert value == json.loads(raw.decode("utf-8"))
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # text through and through


@FUZZ
@given(value=json_values, context=st.sampled_from(CONTEXTS))
@example(value=5, context=CONTEXTS[0])
@example(value=True, context=CONTEXTS[0])
@example(value={"prompt": "\udfff"}, context=CONTEXTS[0])
def test_read_body_decoded_values(value, context):
    """A JSON value TorchServe decoded itself (its TS_DECODE_INPUT_REQUEST on), or a str."""
    for raw in (value, json.dumps(value)):
        try:
            out = api.read_body(raw, context[0])
        except RequestError as e:
            refused(e)
            continue
        json.dumps(out, ensure_ascii=False).encode("utf-8")


@FUZZ
@given(body=native_bodies, context=st.sampled_from(CONTEXTS))
@example(body={"prompt": "a\ud800b"}, context=CONTEXTS[0])
@example(body={"dialog": [{"role": "user", "content": "\udc00"}]}, context=CONTEXTS[0])
@example(body={"prompt": "a", "temperature": 1e-300}, context=CONTEXTS[0])
@example(body={"prompt": ["a"] * 4, "max_new_tokens": 16}, context=CONTEXTS[1])
def test_native_requests(tokenizer, body, context):
    run("native", body, tokenizer, *context)


@FUZZ
@given(route=st.sampled_from(["completions", "chat"]), data=st.data(), context=st.sampled_from(CONTEXTS))
def test_openai_requests(tokenizer, route, data, context):
    body = data.draw(completion_bodies if route == "completions" else chat_bodies)
    run(route, body, tokenizer, *context)


@FUZZ
@given(route=st.sampled_from(["responses", "messages", "count_tokens"]), data=st.data(),
       context=st.sampled_from(CONTEXTS))
@example(route="responses", data=None, context=CONTEXTS[0])
def test_responses_and_messages_requests(tokenizer, route, data, context):
    """Whatever body /v1/responses, /v1/messages and /v1/messages/count_tokens get, from its
    bytes on: a request the engine takes, a token count, or a 4xx in each API's shape."""
    raw = data.draw(serialized(BODIES[route])) if data else b'{"input": [{"type": "function_call"}]}'
    read_and_run(route, raw, tokenizer, context)


@pytest.mark.slow  # thousands of examples
def test_fuzzing_the_new_apis_reaches_both_outcomes(tokenizer):
    """The new routes' strategies produce accepted requests and refusals of many kinds (about
    one count_tokens body in 45 is accepted: 600 examples give each route about 200; these
    draws, derandomized, gave each route 12 outcomes or more, an acceptance among them)."""
    outcomes = {"responses": set(), "messages": set(), "count_tokens": set()}

    @settings(max_examples=600, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(route=st.sampled_from(sorted(outcomes)), data=st.data())
    def collect(route, data):
        body = data.draw(BODIES[route])

        def reparse():
            if route == "count_tokens":
                messages_api.count_tokens(body, tokenizer, "llama", CONTEXTS[0][0])
            parse(route, body, CONTEXTS[0][0])
        outcomes[route].add(outcome(route, body, tokenizer, CONTEXTS[0], reparse))

    collect()
    assert_both_outcomes(outcomes, lambda route, body: run(route, body, tokenizer, *CONTEXTS[0]) is not None)


def outcome(route: str, body, tokenizer, context, reparse) -> str:
    """"accepted", or what refused body: the field reparse's RequestError names, or the
    context (a prompt too long for it)."""
    if run(route, body, tokenizer, *context) is not None:
        return "accepted"
    try:
        reparse()
        return "refused: context"
    except RequestError as e:
        return f"refused: {e.param}"


def assert_both_outcomes(outcomes: dict, accepts):
    """Each route saw refusals of 6 kinds or more, and an accepted body: among those drawn or,
    where none was (Hypothesis's draws in a long run may differ from those of the test
    alone), one that hypothesis.find looks for with accepts(route, body)."""
    for route, seen in outcomes.items():
        assert len(seen) >= 6, (route, seen)
        if "accepted" not in seen:
            find(BODIES[route], lambda body: accepts(route, body),
                 settings=settings(max_examples=10_000, database=None, derandomize=True,
                                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))


tokenize_bodies = request_bodies({"prompt": prompts, "messages": dialogs, "add_special_tokens": flags},
                                 ["prompt", "messages"])
detokenize_bodies = request_bodies({"tokens": id_lists}, ["tokens"])


@FUZZ
@given(body=st.one_of(tokenize_bodies, detokenize_bodies), context=st.sampled_from(CONTEXTS))
@example(body={"tokens": [4096]}, context=CONTEXTS[0])
@example(body={"prompt": "a", "messages": []}, context=CONTEXTS[0])
def test_tokenizer_routes(tokenizer, body, context):
    """vLLM's tokenize and detokenize: an answer of the right shape, or a 4xx."""
    limits, max_seq_len = context
    try:
        out = openai_api.tokenize(body, tokenizer, max_seq_len, limits)
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == max_seq_len
        assert all(0 <= t < tokenizer.n_words for t in out["tokens"])
    except RequestError as e:
        refused(e)
    try:
        out = openai_api.detokenize(body, tokenizer)
        assert out == {"prompt": tokenizer.decode(body["tokens"])}
    except RequestError as e:
        refused(e)


@FUZZ
@given(route=st.sampled_from(["native", "completions", "chat"]), data=st.data(), context=st.sampled_from(CONTEXTS))
def test_bytes_to_prompts(tokenizer, route, data, context):
    """The whole way a body takes in the handler: bytes, JSON, request, prompt tokens."""
    bodies = {"native": native_bodies, "completions": completion_bodies, "chat": chat_bodies}[route]
    read_and_run(route, data.draw(serialized(bodies)), tokenizer, context)


def read_and_run(route: str, raw: bytes, tokenizer, context):
    """A body's bytes read as the handler reads them, then run; a refusal must be a 4xx."""
    try:
        body = api.read_body(raw, context[0])
    except RequestError as e:
        refused(e)
        return
    run(route, body, tokenizer, *context)


@pytest.mark.slow  # thousands of examples
def test_fuzzing_reaches_both_outcomes(tokenizer):
    """The strategies are worth their time: they produce accepted requests as well as refusals
    of many kinds, on both APIs. About one native body in 25 is accepted since messages may
    carry role and content alone: 400 examples give each route about 130; these draws,
    derandomized, gave each route 9 outcomes or more, an acceptance among them."""
    outcomes = {"native": set(), "completions": set(), "chat": set()}

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(route=st.sampled_from(sorted(outcomes)), data=st.data())
    def collect(route, data):
        body = data.draw({"native": native_bodies, "completions": completion_bodies, "chat": chat_bodies}[route])
        outcomes[route].add(outcome(route, body, tokenizer, CONTEXTS[1], lambda: (
            native_api.parse(body, CONTEXTS[1][0], DEFAULTS) if route == "native"
            else openai_api.parse(route, body, "llama", CONTEXTS[1][0], DEFAULTS))))

    collect()
    assert_both_outcomes(outcomes, lambda route, body: run(route, body, tokenizer, *CONTEXTS[1]) is not None)


# --- regressions found by fuzzing ----------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 1e-6])
def test_tiny_temperature_is_greedy(temperature):
    """logits / 1e-40 overflows float32, and the NaN that sampling met failed the request and
    left its KV-cache slot taken (every later step failed): such temperatures decode greedily."""
    req = native_api.parse({"prompt": "a", "temperature": temperature}, Limits(), DEFAULTS)
    assert req.sampling["temperature"] == 0.0
    assert native_api.parse({"prompt": "a", "temperature": 1e-4}, Limits(), DEFAULTS).sampling["temperature"] == 1e-4


def test_failed_prefill_frees_its_blocks(demo_llama, monkeypatch):
    """A step that fails (here: sampling raises) fails the requests in it and gives back
    every KV-cache block they took, so the next request decodes normally."""
    import engine as engine_module
    import handler as handler_module
    from serving import InFlight

    engine = engine_module.Engine(demo_llama.runner, demo_llama.tokenizer)
    h = handler_module.LlamaHandler()
    limits = Limits()
    h.use_engine(engine, InFlight(engine, limits, DEFAULTS, "llama"))
    jobs = h.requests.jobs

    def job(body):
        req = native_api.parse(body, limits, DEFAULTS)
        prompts = api.sequences(req, demo_llama.tokenizer, engine.max_seq_len, limits, DEFAULTS)
        j = api.Job("fuzz", req, True, prompts, {})
        j.seqs = [engine.add(tokens, params) for tokens, params in j.prompts]
        return j

    calls = {"n": 0}
    real_sample = engine_module.sample

    def failing_sample(logits, seqs):
        calls["n"] += 1
        if calls["n"] == 1:  # the step that prefills the three prompts fails
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_sample(logits, seqs)

    monkeypatch.setattr(engine_module, "sample", failing_sample)
    jobs["bad"] = job({"prompt": ["one", "two", "three"], "temperature": 0.5, "max_new_tokens": 4})
    h.start_steps()
    h.wait_for_steps()
    assert jobs["bad"].error is not None and jobs["bad"].error.status == 500
    assert engine.pool.num_used == 0 and not engine.running

    jobs["good"] = job({"prompt": "two", "temperature": 0, "max_new_tokens": 4})
    good = jobs["good"]
    for _ in range(20):  # 4 tokens: a few steps
        if good.seqs and all(s.done for s in good.seqs):
            break
        h.start_steps()
        h.wait_for_steps()
    expected = demo_llama.text_completion(["two"], 4, temperature=0)[0]
    assert good.error is None and good.seqs[0].text == expected["generation"]


@pytest.mark.parametrize("route", ["native", "completions"])
def test_stop_strings_are_capped(route):
    """A stop string over api.MAX_STOP_CHARS is refused, naming each long one; at the limit it
    is accepted. Unbounded ones made the hold-back check cost seconds per iteration."""
    def parse(stop):
        body = {"prompt": "a", "stop": stop}
        return (native_api.parse(body, Limits(), DEFAULTS) if route == "native"
                else openai_api.parse(route, body, "llama", Limits(), DEFAULTS))

    limit = api.MAX_STOP_CHARS
    assert parse(["x" * limit]).sampling["stop"] == ("x" * limit,)
    with pytest.raises(RequestError) as e:
        parse(["ok", "x" * (limit + 1), "y" * 70000])
    assert e.value.param == "stop" and e.value.status == 400
    assert f"stop[1] has {limit + 1}" in e.value.message and "stop[2] has 70000" in e.value.message
