"""/v1/responses and /v1/messages through the official clients against the tests' TorchServe
(TP=2): the openai client (responses.create, responses.stream), the OpenAI Agents SDK
running an agent with a function tool to its final output, and the anthropic client
(messages.create, messages.stream, messages.count_tokens), checked against the chat route's
answers; and what TorchServe's token check means for each client's key."""

import json

import jsonschema
import pytest
from pydantic import Field
from typing_extensions import Annotated

MESSAGES = [{"role": "user", "content": "What should I do on a rainy day?"}]
SYSTEM = "You are a cheerful assistant."
CITY = {"type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 20}}}
PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def client(server):
    # The clients are imported where they are used: every test here needs a server, and importing
    # them took 3 s of CPU in each pytest worker's collection, make test-quick's included.
    import openai

    return openai.OpenAI(base_url=f"{server.url}/predictions/llama/1.0/v1", api_key=server.key, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    """The anthropic client as this server needs it: TorchServe checks the Authorization
    header itself, so the key goes as auth_token (Authorization: Bearer), not api_key."""
    import anthropic

    return anthropic.Anthropic(base_url=f"{server.url}/predictions/llama/1.0", auth_token=server.key, api_key=None,
                               max_retries=0)


def chat(client, messages: list, **options) -> str:
    return client.chat.completions.create(model="llama", messages=messages, **options).choices[0].message.content


# --- openai: responses.create, responses.stream ---------------------------------------------

def test_responses_create_plain_and_with_instructions(client):
    plain = client.responses.create(model="llama", input=MESSAGES[0]["content"], temperature=0, max_output_tokens=30)
    assert plain.status in ("completed", "incomplete") and plain.id.startswith("resp_")
    assert plain.output_text == chat(client, MESSAGES, temperature=0, max_tokens=30)
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0
    instructed = client.responses.create(model="llama", instructions=SYSTEM, input=MESSAGES, temperature=0,
                                         max_output_tokens=30)
    assert instructed.output_text == chat(client, [{"role": "system", "content": SYSTEM}] + MESSAGES, temperature=0,
                                          max_tokens=30)
    assert instructed.instructions == SYSTEM and instructed.output_text != plain.output_text


def test_responses_function_tool_two_turns(client):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": CITY, "strict": True}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="llama", input=ask, tools=tools, tool_choice="required", temperature=1.0,
                                    max_output_tokens=100, extra_body={"seed": 1})
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})}
    second = client.responses.create(model="llama", input=ask + first.output + [result], tools=tools,
                                     temperature=1.0, max_output_tokens=60, extra_body={"seed": 1})
    assert [item.type for item in second.output] == ["message"] and second.output_text


def test_responses_text_format_json_schema(client):
    for seed in range(3):
        reply = client.responses.create(model="llama", input="Invent a person.", temperature=1.0,
                                        max_output_tokens=200, extra_body={"seed": seed},
                                        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                         "strict": True}})
        assert reply.status == "completed"
        jsonschema.validate(json.loads(reply.output_text), PERSON)


def test_responses_stream_adds_up_to_create(client):
    request = {"model": "llama", "instructions": SYSTEM, "input": MESSAGES[0]["content"], "temperature": 1.0,
               "max_output_tokens": 60, "extra_body": {"seed": 7}}
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text and len(text) > 20


def test_responses_are_not_stored(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="llama", input="Hi", store=True)
    assert e.value.body["param"] == "store"
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError, match="responses are not stored"):
            call("resp_123")


def test_agents_sdk_runs_an_agent_with_a_tool(server):
    """The OpenAI Agents SDK's loop over /v1/responses: the model is made to call the tool
    (tool_choice required, which the SDK resets to auto once it has), the SDK runs it and
    sends its output back, and the next answer, text, is the final output."""
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    asked = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "21 C and sunny"

    model = OpenAIResponsesModel("llama", openai.AsyncOpenAI(base_url=f"{server.url}/predictions/llama/1.0/v1",
                                                             api_key=server.key, max_retries=0))
    agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0.6, max_tokens=120,
                                               extra_body={"seed": 2}))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(asked) == 1 and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds


# --- anthropic: messages.create, messages.stream, messages.count_tokens ---------------------

def test_messages_create_plain_and_with_system(client, claude):
    plain = claude.messages.create(model="llama", max_tokens=30, messages=MESSAGES, extra_body={"temperature": 0})
    assert plain.content[0].text == chat(client, MESSAGES, temperature=0, max_tokens=30)
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.id.startswith("msg_")
    system = claude.messages.create(model="llama", max_tokens=30, system=SYSTEM, messages=MESSAGES,
                                    extra_body={"temperature": 0})
    assert system.content[0].text == chat(client, [{"role": "system", "content": SYSTEM}] + MESSAGES, temperature=0,
                                          max_tokens=30)


def test_messages_forced_tool_and_its_result(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model="llama", max_tokens=100, messages=ask, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 1.0, "seed": 3})
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and first.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}
    second = claude.messages.create(model="llama", max_tokens=60, tools=tools,
                                    messages=ask + [{"role": "assistant", "content": first.content}, result],
                                    extra_body={"temperature": 1.0, "seed": 3})
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")


def test_messages_stream_adds_up_to_create_and_count_tokens_to_usage(claude):
    request = {"model": "llama", "max_tokens": 60, "system": SYSTEM, "messages": MESSAGES,
               "extra_body": {"temperature": 1.0, "seed": 1}}
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text and len(text) > 20
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason
    count = claude.messages.count_tokens(model="llama", system=SYSTEM, messages=MESSAGES)
    assert count.input_tokens == whole.usage.input_tokens == final.usage.input_tokens


def test_messages_errors_in_anthropics_shape(claude):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="llama", max_tokens=30, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-sonnet", max_tokens=30, messages=MESSAGES)


def test_the_key_goes_in_authorization(server):
    """TorchServe 0.12.0 reads the key from the Authorization header alone and refuses a
    request without it before the handler sees it: an x-api-key header alone gets its 400.
    The anthropic client (2.17.0) sends api_key as Authorization: Bearer, as it does auth_token."""
    import anthropic

    with_key = anthropic.Anthropic(base_url=f"{server.url}/predictions/llama/1.0", api_key=server.key, max_retries=0)
    assert with_key.messages.create(model="llama", max_tokens=5, messages=MESSAGES).content
    body = {"model": "llama", "max_tokens": 5, "messages": MESSAGES}
    r = server.post(body, path="/1.0/v1/messages", key=None, headers={"x-api-key": server.key})
    assert r.status_code == 400 and "Token Authorization failed" in r.json()["message"], r.text
