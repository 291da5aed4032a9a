"""OpenAI's Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages,
/v1/messages/count_tokens) in this process, at TP=1: the demo model behind serving.InFlight as
the handler drives it (read, admit, an engine step per iteration, message). Each answers
what /v1/chat/completions answers for the same dialog (one way to the prompt), its stream
adds up to its whole answer in the documented event order, forced tool calls and schemas
hold, refusals name the field in the API's own error shape, and no text sent in any field
becomes a special token."""

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import api
import chat_format
import messages_api
import responses_api
from api import Defaults, Limits, Message, RequestError
from engine import Engine
from serving import InFlight
from conftest import read_now
from test_chat_safety import special_text, specials, tokenizers, with_template  # noqa: F401 (a fixture)
from test_tools import LLAMA31_TEMPLATE

MESSAGES = [{"role": "user", "content": "What should I do on a rainy day?"}]
SYSTEM = "You are a cheerful assistant."
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 20}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER}
PATHS = {"chat": "v1/chat/completions", "responses": "v1/responses", "messages": "v1/messages"}


@pytest.fixture(scope="module")
def inflight(demo_llama):
    return InFlight(Engine(demo_llama.runner, demo_llama.tokenizer), Limits(), Defaults(), "llama")


def serve(inflight: InFlight, route: str, body: dict) -> list[Message]:
    """The messages a request gets, iteration by iteration, until its last."""
    req_id = f"r{len(inflight.jobs)}-{id(body)}"
    spec = read_now(inflight, req_id, PATHS.get(route, route), json.dumps(body).encode())
    if isinstance(spec, Message):
        return [spec]
    inflight.admit(req_id, spec, http=True)
    job, messages = inflight.jobs[req_id], []
    while not messages or messages[-1].kind == "chunk":
        inflight.engine.run(1)
        message = inflight.message(job)
        messages += [message] if message is not None else []
    inflight.forget(req_id)
    return messages


def answer(inflight, route: str, body: dict) -> dict:
    (message,) = serve(inflight, route, body)
    assert message.status == 200, message.body
    return json.loads(message.body)


def events(inflight, route: str, body: dict) -> list[dict]:
    """A stream's events, each with its event: name checked against its type."""
    text = "".join(m.body for m in serve(inflight, route, body | {"stream": True}))
    out = []
    for block in filter(None, text.split("\n\n")):
        name, data = block.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {out[-1]['type']}", block
    return out


def chat_text(inflight, body: dict) -> str:
    return answer(inflight, "chat", {"messages": [{"role": "system", "content": SYSTEM}] + MESSAGES} | body)[
        "choices"][0]["message"]["content"]


# --- the same answer as chat completions, whole and streamed ---------------------------------

RESPONSES_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                   "response.content_part.done", "response.output_item.done"]


@pytest.mark.parametrize("max_tokens", [12, 400])
def test_responses_answer_as_chat_and_stream_as_answer(inflight, max_tokens):
    options = {"temperature": 1.0, "seed": 3, "ignore_eos": max_tokens == 12}  # 12 tokens: cut, whatever the draws
    expected = chat_text(inflight, options | {"max_tokens": max_tokens})
    body = {"model": "llama", "instructions": SYSTEM, "input": MESSAGES[0]["content"],
            "max_output_tokens": max_tokens} | options
    whole = answer(inflight, "responses", body)
    (item,) = whole["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == expected
    incomplete = max_tokens == 12
    assert whole["status"] == ("incomplete" if incomplete else "completed")
    assert whole["incomplete_details"] == ({"reason": "max_output_tokens"} if incomplete else None)
    assert whole["id"].startswith("resp_") and whole["instructions"] == SYSTEM
    stream = events(inflight, "responses", body)
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    kinds = [e["type"] for e in stream]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == RESPONSES_ORDER[:5] + [RESPONSES_ORDER[4]] * (deltas - 1) + RESPONSES_ORDER[5:] + [
        f"response.{whole['status']}"]
    assert "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta") == expected
    final = stream[-1]["response"]
    assert final["output"][0]["content"] == item["content"] and final["usage"] == whole["usage"]
    assert stream[0]["response"]["status"] == "in_progress" and stream[0]["response"]["output"] == []


MESSAGES_ORDER = ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop"]


@pytest.mark.parametrize("max_tokens", [12, 400])
def test_messages_answer_as_chat_and_stream_as_answer(inflight, max_tokens):
    options = {"temperature": 1.0, "seed": 4, "ignore_eos": max_tokens == 12}
    expected = chat_text(inflight, options | {"max_tokens": max_tokens})
    body = {"model": "llama", "system": [{"type": "text", "text": SYSTEM}], "messages": MESSAGES,
            "max_tokens": max_tokens} | options
    whole = answer(inflight, "messages", body)
    assert whole["content"] == [{"type": "text", "text": expected}] and whole["id"].startswith("msg_")
    assert whole["stop_reason"] == ("max_tokens" if max_tokens == 12 else "end_turn")
    count = answer(inflight, "v1/messages/count_tokens", {k: body[k] for k in ("model", "system", "messages")})
    assert count == {"input_tokens": whole["usage"]["input_tokens"]}
    stream = events(inflight, "messages", body)
    kinds = [e["type"] for e in stream]
    deltas = kinds.count("content_block_delta")
    assert kinds == MESSAGES_ORDER[:4] + [MESSAGES_ORDER[3]] * (deltas - 1) + MESSAGES_ORDER[4:]
    assert "".join(e["delta"]["text"] for e in stream if e["type"] == "content_block_delta") == expected
    assert stream[0]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert stream[-2]["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert stream[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_a_stop_sequence_is_named(inflight):
    body = {"model": "llama", "messages": MESSAGES, "max_tokens": 30, "temperature": 0}
    text = answer(inflight, "messages", body)["content"][0]["text"]
    stop = text.split()[3]
    cut = answer(inflight, "messages", body | {"stop_sequences": ["zzz", stop]})
    assert cut["content"] == [{"type": "text", "text": text[:text.index(stop)]}]
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", stop)


def test_forced_calls_stream_as_they_answer(inflight):
    """A forced call: a function_call item / a tool_use block whose arguments meet the
    schema; streamed, its argument deltas add up to them; the call's result goes back in the
    next turn."""
    body = {"model": "llama", "input": "What is the weather in Paris?", "tools": [RESPONSES_TOOL],
            "tool_choice": "required", "temperature": 1.0, "seed": 5, "max_output_tokens": 200}
    (call,) = answer(inflight, "responses", body)["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    stream = events(inflight, "responses", body)
    assert [e["type"] for e in stream][2:4] == ["response.output_item.added", "response.function_call_arguments.delta"]
    assert "".join(e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta") \
        == call["arguments"]
    assert stream[-1]["response"]["output"][0]["arguments"] == call["arguments"]
    turn = body | {"tool_choice": "none", "input": [{"role": "user", "content": body["input"]}, call,
                                                    {"type": "function_call_output", "call_id": call["call_id"],
                                                     "output": '{"celsius": 21}'}]}
    assert answer(inflight, "responses", turn)["output"][0]["type"] == "message"

    body = {"model": "llama", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
            "temperature": 1.0, "seed": 5, "max_tokens": 200}
    message = answer(inflight, "messages", body)
    (block,) = message["content"]
    assert block["type"] == "tool_use" and message["stop_reason"] == "tool_use"
    count = answer(inflight, "v1/messages/count_tokens", {k: body[k] for k in ("model", "messages", "tools",
                                                                              "tool_choice")})
    assert count == {"input_tokens": message["usage"]["input_tokens"]}
    jsonschema.validate(block["input"], WEATHER)
    stream = events(inflight, "messages", body)
    assert json.loads("".join(e["delta"]["partial_json"] for e in stream if e["type"] == "content_block_delta")) \
        == block["input"]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "21 C"}]}
    turn = body | {"tool_choice": {"type": "none"}, "messages": body["messages"] + [
        {"role": "assistant", "content": [block]}, result]}
    assert answer(inflight, "messages", turn)["content"][0]["type"] == "text"


def test_schemas_hold(inflight):
    schema = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    for seed in range(2):
        reply = answer(inflight, "responses", {
            "model": "llama", "input": "A person:", "temperature": 1.0, "seed": seed, "max_output_tokens": 200,
            "text": {"format": {"type": "json_schema", "name": "person", "schema": schema}}})
        jsonschema.validate(json.loads(reply["output"][0]["content"][0]["text"]), schema)
        reply = answer(inflight, "messages", {
            "model": "llama", "messages": [{"role": "user", "content": "A person:"}], "temperature": 1.0,
            "seed": seed, "max_tokens": 200, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        jsonschema.validate(json.loads(reply["content"][0]["text"]), schema)


def test_a_stream_that_fails_ends_in_the_apis_shape(inflight):
    for route, body in (("responses", {"input": "Hi", "stream": True}),
                        ("messages", {"model": "llama", "messages": MESSAGES, "max_tokens": 5, "stream": True})):
        spec = read_now(inflight, "failing", PATHS[route], json.dumps(body).encode())
        inflight.admit("failing", spec, http=True)
        job = inflight.jobs["failing"]
        while inflight.message(job) is None:
            inflight.engine.run(1)
        job.error = RequestError("internal error: boom", None, status=500)
        last = inflight.message(job)
        inflight.forget("failing")
        name, data = last.body.strip().split("\n")
        data = json.loads(data.removeprefix("data: "))
        if route == "responses":
            assert name == "event: response.failed" and data["response"]["status"] == "failed"
            assert data["response"]["error"] == {"code": "server_error", "message": "internal error: boom"}
        else:
            assert name == "event: error"
            assert data == {"type": "error", "error": {"type": "api_error", "message": "internal error: boom"}}


# --- refusals: a 4xx naming the field, in each API's shape ----------------------------------

OK_RESPONSE = {"model": "llama", "input": "Hi"}
OK_MESSAGE = {"model": "llama", "messages": MESSAGES, "max_tokens": 8}
REFUSED = [
    ("responses", {"store": True}, 400, "store", "store: true is not supported"),
    ("responses", {"previous_response_id": "resp_1"}, 400, "previous_response_id", "send the earlier items"),
    ("responses", {"include": ["message.output_text.logprobs"]}, 400, "include", "is not supported"),
    ("responses", {"reasoning": {"effort": "high"}}, 400, "reasoning", "is not supported"),
    ("responses", {"prompt": {"id": "p"}}, 400, "prompt", "unknown field 'prompt'"),
    ("responses", {"model": "gpt-5"}, 404, "model", "does not exist"),
    ("responses", {"input": []}, 400, "input", "non-empty list"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input", "input[0].content must be a string or a list of text parts"),
    ("responses", {"input": [{"type": "reasoning", "summary": []}]}, 400, "input", 'got type "reasoning"'),
    ("responses", {"input": [{"role": "robot", "content": "x"}]}, 400, "input", "input[0].role must be one of"),
    ("responses", {"tools": [{"type": "web_search"}]}, 400, "tools", "other tools are not supported"),
    ("responses", {"tools": [RESPONSES_TOOL | {"name": "a b"}]}, 400, "tools", "tools[0].name must be"),
    ("responses", {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400,
     "tool_choice", "not among tools"),
    ("responses", {"tools": [RESPONSES_TOOL], "tool_choice": "required",
                   "text": {"format": {"type": "json_object"}}}, 400, "text", "cannot take a text.format"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
     "text", "text.format.schema is not a JSON schema that can be enforced"),
    ("responses", {"max_output_tokens": 100000}, 400, "max_output_tokens", "between 1 and 512"),
    ("responses", {"temperature": 3}, 400, "temperature", "temperature must be in"),
    ("messages", {"max_tokens": None}, 400, "max_tokens", "max_tokens is required"),
    ("messages", {"model": None}, 400, "model", "model is required"),
    ("messages", {"model": "claude"}, 404, "model", "does not exist"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking", "is not supported"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages",
     'got type "image"'),
    ("messages", {"messages": [{"role": "system", "content": "x"}]}, 400, "messages", "user or assistant"),
    ("messages", {"messages": [{"role": [], "content": ""}]}, 400, "messages", "user or assistant"),
    ("messages", {"messages": MESSAGES + [{"role": "assistant", "content": "Go"}]}, 400, "messages",
     "must end with a user"),  # a prefill
    ("messages", {"stop_sequences": ["a"] * 17}, 400, "stop_sequences", "at most 16"),
    ("messages", {"top_k": -1}, 400, "top_k", "top_k must be between"),
    ("messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools",
     "server tools are not supported"),
    ("messages", {"tools": [ANTHROPIC_TOOL | {"input_schema": {"type": "string"}}]}, 400, "tools",
     "tools[0].input_schema must be a JSON schema"),
    ("messages", {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool"}}, 400, "tool_choice", "tool_choice must"),
    ("messages", {"stop": ["a"]}, 400, "stop", "unknown field 'stop'"),
    ("v1/messages/count_tokens", {"max_tokens": 5}, 400, "max_tokens", "unknown field 'max_tokens'"),
    ("v1/responses/resp_123", {}, 404, "url", "responses are not stored"),
    ("v1/messages/batches", {}, 404, "url", "no route /v1/messages/batches"),
]


@pytest.mark.parametrize("route, fields, status, param, words", REFUSED)
def test_refusals_name_the_field_in_the_apis_shape(inflight, route, fields, status, param, words):
    anthropic = "messages" in route
    body = {k: v for k, v in ((OK_MESSAGE if anthropic else OK_RESPONSE) | fields).items() if v is not None}
    (message,) = serve(inflight, route, body)
    error = json.loads(message.body)
    assert message.status == status
    if anthropic:
        kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert error["type"] == "error" and error["error"]["type"] == kind and set(error["error"]) == {"type", "message"}
        assert words in error["error"]["message"], error
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] == param
        assert words in error["error"]["message"], error


# --- one way to the prompt, where no text becomes a special token --------------------------

@pytest.fixture(scope="module")
def formats(tokenizers) -> dict:  # noqa: F811
    """test_chat_safety's tokenizers and one whose template reads tools (Llama 3.1's, in
    short): a template that does not falls back to Meta's Llama 3 format for tools."""
    return tokenizers | {"llama31": with_template(tokenizers["template"], LLAMA31_TEMPLATE)}


def chat_tokens(tokenizer, dialog, tools=None) -> list[int]:
    return chat_format.encode_dialog(tokenizer, dialog, tools)


def prompt(tokenizer, module, body: dict) -> list[int]:
    req = module.parse(body, "llama", Limits(), Defaults())
    return api.sequences(req, tokenizer, 4096, Limits(), Defaults())[0][0]


def responses_body(text: list[str]) -> dict:
    """A Responses request with a text in every field that reaches the prompt."""
    return {"model": "llama", "instructions": text[0], "tools": [RESPONSES_TOOL | {"description": text[1]}],
            "tool_choice": "auto", "input": [
                {"role": "user", "content": [{"type": "input_text", "text": text[2]}]},
                {"type": "function_call", "call_id": text[3], "name": "get_weather",
                 "arguments": json.dumps({"city": text[4]})},
                {"type": "function_call_output", "call_id": text[3], "output": text[5]}]}


def messages_body(text: list[str]) -> dict:
    return {"model": "llama", "max_tokens": 8, "system": [{"type": "text", "text": text[0]}],
            "tools": [ANTHROPIC_TOOL | {"description": text[1]}], "messages": [
                {"role": "user", "content": [{"type": "text", "text": text[2]}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": text[3], "name": "get_weather",
                                                   "input": {"city": text[4]}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": text[3],
                                              "content": [{"type": "text", "text": text[5]}]}]}]}


def chat_dialog(text: list[str], **function) -> tuple[list, list]:
    """The same as a chat completions request: (messages, tools); function: more of the tool's keys."""
    call = {"id": text[3], "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.dumps({"city": text[4]})}}
    tool = {"type": "function", "function": CHAT_TOOL["function"] | function | {"description": text[1]}}
    return [{"role": "system", "content": text[0]}, {"role": "user", "content": text[2]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": text[3], "content": text[5]}], [tool]


@pytest.mark.parametrize("fmt", ["llama31", "llama3", "llama2"])
def test_both_apis_render_as_chat_completions(formats, fmt):
    tok = formats[fmt]
    text = ["Be brief.", "The weather.", "Weather in Paris?", "call_1", "Paris", '{"celsius": 21}']
    assert prompt(tok, responses_api, responses_body(text)) == chat_tokens(tok, *chat_dialog(text, strict=True))
    assert prompt(tok, messages_api, messages_body(text)) == chat_tokens(tok, *chat_dialog(text))


@pytest.mark.parametrize("fmt", ["llama31", "llama3", "llama2"])
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.lists(special_text, min_size=6, max_size=6))
def test_no_field_forges_a_special_token(formats, fmt, text):
    """Special-token text in every field that reaches the prompt (instructions / system, a
    tool's description, message text, a call's id and arguments, a call's result): the
    request is refused (400), or its prompt has the special tokens of the same request with
    neutral text."""
    tok = formats[fmt]
    neutral = ["x", "x", "x", "call_1", "x", "x"]
    for module, body in ((responses_api, responses_body), (messages_api, messages_body)):
        try:
            tokens = prompt(tok, module, body(text))
        except RequestError as e:
            assert e.status == 400, e.message
            continue
        assert specials(tok, tokens) == specials(tok, prompt(tok, module, body(neutral)))
