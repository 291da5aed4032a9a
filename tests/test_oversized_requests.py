"""Requests too deep or too large, and failures inside the server (issue 44, item 5), read as
rank 0 reads them (serving.InFlight.read, what the handler calls with TorchServe's bytes):
JSON nested past json_nesting.MAX_DEPTH, or a schema nested past it through its $refs, is a
400 that says where, in well under a second; a 1 MiB schema and 128 tools are 4xx that say
what is wrong; a bug is a 500 whose message names the request id that the log line has, and
nothing of the exception."""

import json
import re
import time

import pytest

import api
import llama2
from api import Defaults, Limits
from conftest import DEMO, read_now
from engine import Engine
from serving import InFlight

CHAT = "v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
# A refusal's cost in the CPU seconds of the two threads that make it: the one that reads the
# request and its InFlight's grammars thread. Under `make test` the other worker, servers and
# g++ share the two cores: a 0.07 s refusal once took 1.1 s of wall time, and the process's CPU
# time, which counts other tests' threads too, failed the 1 MiB schema's test (0.3 s alone).
# The wall clock only shows that nothing waits.
FAST = 1.0
NOT_STUCK = 10.0


@pytest.fixture(scope="module")
def engine():
    """DEMO's engine, its tokenizer's table in llguidance built (Engine.vocabulary: once, at a
    process's first constraint; 0.2 s alone here): the refusals below are timed without it. In
    a fresh clone's `make test`, the $ref chain's refusal, the first to build it, took 1.06 s."""
    llama = llama2.tp_llama(None, DEMO, None, 1, max_batch_size=2, max_seq_len=512)
    engine = Engine(llama.runner, llama.tokenizer)
    assert engine.vocabulary is not None
    return engine


def refused(engine, body: dict | str, limits: Limits = Limits(), path: str = CHAT) -> tuple[int, dict]:
    """(status, the error: OpenAI's error object, or the whole body in other APIs) for body, timed."""
    raw = (body if isinstance(body, str) else json.dumps(body)).encode()
    inflight = InFlight(engine, limits, Defaults(), "llama")
    begin, cpu = time.perf_counter(), time.thread_time()
    message = read_now(inflight, "req-1", path, raw)
    # the grammars thread is this InFlight's own: all of its CPU time is this request's
    cpu = time.thread_time() - cpu + (inflight.compiler.submit(time.thread_time).result() if inflight.compiler else 0)
    assert cpu < FAST and time.perf_counter() - begin < NOT_STUCK
    assert isinstance(message, api.Message), "a job: it was not refused"
    answer = json.loads(message.body)
    return message.status, answer["error"] if path == CHAT else answer


def schema_body(schema) -> dict:
    return {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.parametrize("levels", [300, 1000])
def test_a_deep_schema_is_a_400_that_says_where(engine, levels):
    schema = '{"type": "object", "properties": {"a": ' * levels + '{"type": "integer"}' + "}}" * levels
    status, error = refused(engine, json.dumps(schema_body("SCHEMA")).replace('"SCHEMA"', schema))
    assert status == 400 and error["param"] in ("response_format", "body"), error
    assert re.fullmatch(r"(response_format\.json_schema\.schema\.properties\.a\.properties\.\.\.|the request body) "
                        r"nests arrays and objects more than 64 levels deep", error["message"]), error


def test_deep_json_anywhere_is_a_400_naming_its_field(engine):
    deep = [[[]]]
    for _ in range(70):
        deep = [deep]
    for path, body, field in [(CHAT, {"messages": HI, "stop": deep}, "stop"),
                              ("", {"prompt": "Hi", "structured_outputs": {"json": deep}}, "structured_outputs"),
                              ("v1/messages", {"model": "llama", "max_tokens": 8, "messages": [
                                  {"role": "user", "content": [{"type": "text", "text": "Hi", "x": deep}]}]}, "messages")]:
        status, error = refused(engine, body, path=path)
        assert status == 400 and "nests arrays and objects more than 64 levels deep" in json.dumps(error), error


def test_a_schema_deep_through_its_references_is_a_400(engine):
    chain = {"$defs": {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(2000)}
             | {"d2000": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    status, error = refused(engine, schema_body(chain))
    assert status == 400 and error["message"] == (
        "response_format.json_schema.schema is not a JSON schema that can be enforced: it nests schemas more "
        "than 64 levels deep, counting each $ref it follows"), error


def test_a_schema_of_a_mebibyte_is_refused_saying_why(engine):
    big = {"type": "object", "properties": {f"key_{i}": {"type": "string", "maxLength": 10} for i in range(21500)}}
    body = schema_body(big)
    assert len(json.dumps(body)) > 1 << 20
    status, error = refused(engine, body)
    assert status == 413 and re.fullmatch(r"the request body has \d+ bytes, the limit is 1048576", error["message"])
    status, error = refused(engine, body, Limits(max_body_bytes=4 << 20))
    assert status == 400 and re.fullmatch(r"response_format.json_schema.schema is not a JSON schema that can be "
                                          r"enforced: \d+ bytes as compact JSON, more than the 131072 this server "
                                          r"compiles", error["message"]), error


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_128_tools_are_a_400_when_they_do_not_fit(engine, tool_choice):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"does thing {i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}, "n": {"type": "integer"}}, "required": ["x"]}}}
             for i in range(128)]
    status, error = refused(engine, {"messages": HI, "tools": tools, "tool_choice": tool_choice})
    assert status == 400 and re.fullmatch(r"messages has \d+ tokens, the limit is 511", error["message"]), error


def test_a_bug_is_a_500_naming_the_request_id_only(engine, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise KeyError("secret internal detail")

    monkeypatch.setattr("openai_api.parse", broken)
    status, error = refused(engine, {"messages": HI})
    assert status == 500 and error == {
        "message": "internal error; the server's log has the details under request id req-1",
        "type": "server_error", "param": None, "code": 500}
    logged, = [r for r in caplog.records if r.getMessage() == "cannot read request req-1"]
    assert "secret internal detail" in logged.exc_text  # the log has the exception, the answer does not


def test_a_grammar_is_compiled_after_every_cheap_check(engine, monkeypatch):
    """Compiling is the costly check, so it comes last: a request refused for its prompt's
    length compiles nothing, and one that passes compiles its schema once."""
    compiled = []
    monkeypatch.setattr(engine, "matcher", compiled.append)
    too_long = schema_body({"type": "object"}) | {"messages": [{"role": "user", "content": "word " * 600}]}
    status, error = refused(engine, too_long)
    assert status == 400 and error["param"] == "messages" and not compiled, error
    read = read_now(InFlight(engine, Limits(), Defaults(), "llama"), "req-2", CHAT, json.dumps(schema_body({})).encode())
    assert not isinstance(read, api.Message) and [c.kind for c in compiled] == ["json_schema"]
