"""Structured outputs and tool calls through the clients applications use, the official
openai client and LangChain's ChatOpenAI, against TorchServe at TP=1: on the demo model
(sentencepiece, Llama 2's chat format) and on a Llama 3 fixture (a BPE of Meta's form, with
Llama 3.1's Hugging Face chat template, which lays out tools). Answers sampled at temperature 1 with several seeds validate
with the jsonschema package; regexes and choices match; a forced tool call's arguments
validate against the tool's parameters, streamed deltas add up to the same call, and a tool
loop's result goes back as a `tool` message. (The shared server's clients, in
test_constrained.py and test_responses_messages_clients.py, meet rank 0's grammars at TP=2;
one rank here costs this module 30 s of the machine's CPU against 38 s with two.)"""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import regex
from pydantic import BaseModel, Field, StringConstraints
from typing_extensions import Annotated

from conftest import DEMO, SERVER_SLOTS
from local_server import start_server
from test_structured import CHOICES, REGEXES, SCHEMAS
from test_tools import LLAMA31_TEMPLATE

pytestmark = pytest.mark.slow  # TorchServe
SEEDS = (0, 1, 2)
MAX_TOKENS = 400
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module", params=["demo", "llama3"])
def srv(request, tmp_path_factory):
    """Contexts longer than the shared server's: the demo's tokenizer of 4,096 tokens spells
    the tools' prompt in about 950 tokens, the Llama 3 fixture's in about 600 (a copy of it
    whose config.json allows 1,024 positions, not 512, and whose template is Llama 3.1's)."""
    workdir = tmp_path_factory.mktemp(request.param)
    folder = DEMO
    if request.param == "llama3":
        folder = shutil.copytree(request.getfixturevalue("llama3")["meta_untied"][1]["hf"], workdir / "weights")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": LLAMA31_TEMPLATE}))
    srv = start_server(workdir / "server", str(folder), tp=1, threads=1, batch_size=SERVER_SLOTS,
                       handler={"max_seq_len": 2048 if request.param == "demo" else 1024})
    yield srv
    srv.stop(wait=False)


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/predictions/llama/1.0/v1", api_key=srv.key, max_retries=0)


def in_parallel(fn, items: list) -> list:
    with ThreadPoolExecutor(SERVER_SLOTS) as pool:  # the server batches them
        return list(pool.map(fn, items))


def test_json_schemas_validate(srv):
    client = client_of(srv)
    messages = [{"role": "user", "content": "Answer in JSON."}]

    def ask(case):
        name, seed = case
        response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        return client.chat.completions.create(model="llama", messages=messages, response_format=response_format,
                                              temperature=1.0, top_p=0.9, seed=seed, max_tokens=MAX_TOKENS).choices[0]

    cases = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    for (name, seed), choice in zip(cases, in_parallel(ask, cases)):
        assert choice.finish_reason == "stop", (name, seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name],
                            format_checker=jsonschema.FormatChecker())


def test_regexes_and_choices_match(srv):
    client = client_of(srv)

    def ask(case):
        field, value, seed = case
        return client.completions.create(model="llama", prompt="Write it:", temperature=1.0, seed=seed,
                                         max_tokens=64, extra_body={field: value}).choices[0]

    cases = [("guided_regex", r, seed) for r in REGEXES for seed in SEEDS]
    cases += [("structured_outputs", {"choice": CHOICES}, seed) for seed in range(4)]
    for (field, value, _), choice in zip(cases, in_parallel(ask, cases)):
        assert choice.finish_reason == "stop", (value, choice.text)
        if field == "guided_regex":
            assert regex.fullmatch(value, choice.text), (value, choice.text)  # the Unicode llguidance knows
        else:
            assert choice.text in CHOICES, choice.text


class Person(BaseModel):
    """Someone described by the model."""
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    tags: list[Annotated[str, StringConstraints(max_length=10)]] = Field(max_length=3)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(srv, method):
    """with_structured_output: LangChain sends response_format (json_schema) or a forced tool
    (function_calling) and parses the answer into the pydantic model itself."""
    from langchain_openai import ChatOpenAI

    schema = Person.model_json_schema()
    for seed in SEEDS:
        chat = ChatOpenAI(model="llama", base_url=f"{srv.url}/predictions/llama/1.0/v1", api_key=srv.key,
                          temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, max_retries=0)
        person = chat.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(person, Person)
        jsonschema.validate(person.model_dump(), schema)


def test_langchain_forced_tool_and_its_result(srv):
    """bind_tools with a forced tool, then the tool's result sent back (a `tool` message after
    the assistant's call) for the answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="llama", base_url=f"{srv.url}/predictions/llama/1.0/v1", api_key=srv.key,
                      temperature=1.0, seed=3, max_tokens=MAX_TOKENS, max_retries=0)
    ask = HumanMessage("What is the weather in Paris?")
    call = chat.bind_tools([WEATHER, TIME], tool_choice="get_weather").invoke([ask])
    (tool_call,) = call.tool_calls
    assert tool_call["name"] == "get_weather" and tool_call["id"].startswith("call_")
    jsonschema.validate(tool_call["args"], WEATHER["function"]["parameters"])
    result = ToolMessage(json.dumps({"temperature": 21}), tool_call_id=tool_call["id"])
    answer = chat.bind_tools([WEATHER, TIME], tool_choice="none").invoke([ask, call, result])
    assert not answer.tool_calls and answer.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_stream_as_deltas_that_add_up(srv, tool_choice):
    client = client_of(srv)
    request = {"model": "llama", "messages": [{"role": "user", "content": "Use a tool."}], "tools": [WEATHER, TIME],
               "tool_choice": tool_choice, "temperature": 1.0, "seed": 5, "max_tokens": MAX_TOKENS}
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    names, arguments, finish = [], "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for part in chunk.choices[0].delta.tool_calls or []:
            names += [part.function.name] if part.function.name else []
            arguments += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (names, arguments, finish) == ([call.function.name], call.function.arguments, "tool_calls")


def test_bad_tool_requests_are_refused(srv):
    client = client_of(srv)
    messages = [{"role": "user", "content": "Hi"}]
    for fields, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
                          ({"tools": [WEATHER], "tool_choice": "required",
                            "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="llama", messages=messages, **fields)
        assert e.value.body["param"] == param, e.value.body
