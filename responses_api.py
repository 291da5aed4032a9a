"""OpenAI's Responses API, POST /v1/responses. A request's input items, instructions and
function tools become the chat Request that /v1/chat/completions makes (so the prompt is
rendered by chat_format, and tools, forced calls and text.format are enforced as there);
its answers take the Responses shapes: a response object with output items, or typed
server-sent events numbered by sequence_number. Stateless: nothing is stored, so store:
true and previous_response_id are refused (docs/api.md says why)."""

import json
import secrets

import api
import constraint_fields
import openai_api
import tool_calls
from api import Defaults, Limits, Request, RequestError
from sequence import Sequence
from structured import Constraint

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
          "max_output_tokens", "stream", "metadata", "user", "safety_identifier", "prompt_cache_key",
          "prompt_cache_retention", "stream_options"} | set(api.SAMPLING_FIELDS)
# Accepted only at these values (the first is the one named when refusing): what they would
# change is not implemented
NEUTRAL = {"store": (False,), "background": (False,), "include": ([],), "truncation": ("disabled",),
           "top_logprobs": (0,), "reasoning": ({},), "service_tier": ("auto", "default")}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # a part's type: its text's key
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"}}
UNSTORED = ("responses are not stored on this server (store: true is refused), so there are none to "
            "retrieve, cancel or delete")


def parse(body, model_name: str, limits: Limits, defaults: Defaults) -> Request:
    """Its constraint is compiled later (constraint_fields.compile_constraints)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {api.type_name(body)}", None)
    if body.get("store") is True:
        raise RequestError(f"store: true is not supported: {UNSTORED}; send store: false or leave it out",
                           "store")
    if body.get("previous_response_id") is not None:
        raise RequestError(f"previous_response_id is not supported: {UNSTORED}; send the earlier items in input",
                           "previous_response_id")
    api.check_fields(body, FIELDS, NEUTRAL | {"previous_response_id": ()})
    api.check_model(body, model_name)
    req = Request("responses", chat=True, input_field="input")
    req.inputs = [dialog(body, limits)]
    req.max_new_tokens = api.get_int(body, "max_output_tokens", 1, limits.max_new_tokens)
    req.sampling = {"logprobs": False, "top_logprobs": 0, "echo": False,
                    "constraint": None} | api.sampling_fields(body, defaults, top_p="top_p")
    req.stream = api.get_bool(body, "stream")
    format_constraint = text_format(body.get("text"), req.to_compile)
    choice = function_tools(req, body)
    if format_constraint is not None:
        if req.sampling["constraint"] is not None:
            raise RequestError(f"tool_choice {json.dumps(body['tool_choice'])} forces a function call; it cannot "
                               "take a text.format as well", "text")
        req.sampling["constraint"] = format_constraint
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise RequestError("metadata must be an object of strings", "metadata")
    if not isinstance(body.get("user", ""), str):
        raise RequestError("user must be a string", "user")
    # what the response object repeats of the request
    req.state["echo"] = {"instructions": body.get("instructions"), "metadata": metadata or {},
                         "max_output_tokens": req.max_new_tokens, "temperature": req.sampling["temperature"],
                         "top_p": req.sampling["top_p"], "tools": body.get("tools") or [], "tool_choice": choice,
                         "parallel_tool_calls": body.get("parallel_tool_calls", True),
                         "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
                         "user": body.get("user"), "previous_response_id": None, "reasoning": None,
                         "truncation": "disabled", "store": False, "background": False}
    return req


def dialog(body: dict, limits: Limits) -> list:
    """instructions (a system message) and input (a string: one user message; or items:
    messages, function_call and function_call_output) as the chat route's messages."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string", "instructions")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items", "input")
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = api.kind_of(item, "message")
        if kind not in ITEM_KEYS:
            raise RequestError(f"{where} must be a message, function_call or function_call_output item"
                               + (f", got type {json.dumps(kind)}" if kind else ""), "input")
        unknown = sorted(map(str, set(item) - ITEM_KEYS[kind]))
        if unknown:
            raise RequestError(f"{where} has the key {unknown[0]!r}; {kind} items have "
                               f"{', '.join(sorted(ITEM_KEYS[kind]))}", "input")
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}", "input")
            messages.append({"role": ROLES[item["role"]], "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one answer
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": text_of(item.get("output"), f"{where}.output")})
    return api.get_dialog({"input": messages}, "input", limits)


def text_of(content, where: str) -> str:
    """A string, or a list of text parts (input_text, output_text, refusal), as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get(TEXT_PARTS.get(api.kind_of(p))), str)
                                                for p in content):
        raise RequestError(f"{where} must be a string or a list of text parts ({', '.join(TEXT_PARTS)}); "
                           "other parts are not supported", "input")
    return "".join(p[TEXT_PARTS[p["type"]]] for p in content)


def text_format(text, to_compile: list) -> Constraint | None:
    """text.format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "name", "schema", "strict"?, "description"?} (the schema enforced whatever strict says)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise RequestError('text must be an object with "format" (and "verbosity")', "text")
    spec = text.get("format")
    if spec is None or (isinstance(spec, dict) and spec.get("type") == "text"):
        return None
    if isinstance(spec, dict) and spec.get("type") == "json_object":
        return Constraint("json_object")
    if not (isinstance(spec, dict) and spec.get("type") == "json_schema" and isinstance(spec.get("name"), str)
            and spec.get("schema") is not None):
        raise RequestError('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                           '"json_schema", "name": ..., "schema": {...}}', "text")
    constraint = Constraint("json_schema", spec["schema"])
    problem = f"text.format.schema {constraint_fields.PROBLEM['json_schema']}"
    constraint_fields.check_compiles(constraint, to_compile, problem, "text")
    return constraint


def function_tools(req: Request, body: dict):
    """req's tools and the constraint of a forced call, as the chat route sets them (from the
    Responses shapes: {"type": "function", "name", "parameters", "strict", "description"},
    tool_choice {"type": "function", "name"}). Returns tool_choice as the response repeats it."""
    given = body.get("tools") or []
    if not isinstance(given, list):
        raise RequestError("tools must be a list of function tools", "tools")
    chat_tools = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"tools[{i}] must be a function tool ({{\"type\": \"function\", \"name\": ...}}); "
                               "other tools are not supported", "tools")
        try:
            tool_calls.check_keys(tool, f"tools[{i}]", {"type", "name"}, {"description", "parameters", "strict"})
        except ValueError as e:
            raise RequestError(str(e), "tools") from None
        chat_tools.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                             if k != "type" and v is not None}})
    api.check_text(chat_tools, "tools", "tools")
    choice = body.get("tool_choice")
    chat_choice = choice
    if isinstance(choice, dict):
        if set(choice) != {"type", "name"} or choice["type"] != "function":
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                               "tool_choice")
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    chat_body = {"tools": chat_tools, "tool_choice": chat_choice, "parallel_tool_calls": body.get("parallel_tool_calls")}
    try:
        openai_api.tool_call_constraint(req, chat_body)
    except RequestError as e:
        raise RequestError(e.message.replace(".function.", "."), e.param) from None
    return choice if choice is not None else ("auto" if chat_tools else "none")


# --- answers: one writer for the whole answer and for the stream -------------------------

class Output:
    """A response's output items as its text arrives (message items with output_text,
    function_call items, in the order the text gives them: tool_calls.ToolCallStream tells calls
    from text), and the typed events that tell of them, numbered."""

    def __init__(self, req: Request, meta: dict):
        self.req, self.meta = req, meta
        self.number = 0  # the next event's sequence_number
        self.items: list[dict] = []
        self.open = False  # the last item is still being written
        self.calls = tool_calls.ToolCallStream(req.tools) if req.tools else None

    def event(self, kind: str, **fields) -> dict:
        self.number += 1
        return {"type": kind, "sequence_number": self.number - 1} | fields

    def add(self, text: str) -> list[dict]:
        return self.follow(self.calls.add(text) if self.calls else [{"content": text}] if text else [])

    def finish(self, seq: Sequence) -> list[dict]:
        """The events of the text held back, and of the last item's end."""
        events = self.follow(self.calls.finish()) if self.calls else []
        return events + self.close("incomplete" if seq.finish_reason == "length" else "completed")

    def follow(self, deltas: list[dict]) -> list[dict]:
        """Events for ToolCallStream's deltas: text, a call's head, a piece of its arguments."""
        events = []
        for delta in deltas:
            item = self.items[-1] if self.open else None
            if "content" in delta:
                if item is None or item["type"] != "message":
                    events += self.close() + self.begin({"id": f"msg_{secrets.token_hex(12)}", "type": "message",
                                                         "role": "assistant", "status": "in_progress", "content": []})
                    item = self.items[-1]
                    item["content"].append(text_part(""))
                    events.append(self.event("response.content_part.added", item_id=item["id"],
                                             output_index=len(self.items) - 1, content_index=0, part=text_part("")))
                item["content"][0]["text"] += delta["content"]
                events.append(self.event("response.output_text.delta", item_id=item["id"],
                                         output_index=len(self.items) - 1, content_index=0, delta=delta["content"],
                                         logprobs=[]))
                continue
            call = delta["tool_calls"][0]
            if "id" in call:  # a new call
                events += self.close() + self.begin({"id": f"fc_{call['id'].removeprefix('call_')}",
                                                     "type": "function_call", "status": "in_progress",
                                                     "call_id": call["id"], "name": call["function"]["name"],
                                                     "arguments": ""})
            else:
                item["arguments"] += call["function"]["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=len(self.items) - 1, delta=call["function"]["arguments"]))
        return events

    def begin(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = True
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=json_copy(item))]

    def close(self, status: str = "completed") -> list[dict]:
        """The end of the item being written, if any."""
        if not self.open:
            return []
        self.open = False
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=json_copy(part))]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=index, item=json_copy(item))]

    def response(self, seq: Sequence | None = None) -> dict:
        """The response object: in progress (seq None: the items so far are not in it), or
        completed, or incomplete (max_output_tokens cut it)."""
        status = "in_progress" if seq is None else "incomplete" if seq.finish_reason == "length" else "completed"
        out = {"id": self.meta["id"], "object": "response", "created_at": self.meta["created"], "status": status,
               "model": self.meta["model"], "output": [] if seq is None else json_copy(self.items), "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "usage": None if seq is None else usage(seq)}
        return out | self.req.state["echo"]


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def json_copy(value):
    """value as it stands now (an event's item must not change with the item)."""
    return json.loads(json.dumps(value))


def usage(seq: Sequence) -> dict:
    """The message's tokens, as the chat route counts them (the stop id not among them)."""
    prompt, completion = len(seq.prompt_tokens), len(seq.tokens)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def output(req: Request, meta: dict) -> Output:
    """The request's Output, made at its first piece."""
    if "output" not in req.state:
        req.state["output"] = Output(req, meta)
    return req.state["output"]


def answer(req: Request, seqs: list[Sequence], tokenizer, meta: dict) -> dict:
    writer = Output(req, meta)
    writer.add(seqs[0].text)
    writer.finish(seqs[0])
    return writer.response(seqs[0])


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


STREAM_TYPE = "text/event-stream"
CHOICE_ERRORS = False  # a request whose grammar broke fails: no finish reason says so


def chunk(req: Request, meta: dict, index: int, text: str, first: bool) -> str:
    writer = output(req, meta)
    events = []
    if first:
        events = [writer.event(kind, response=writer.response()) for kind in ("response.created",
                                                                              "response.in_progress")]
    return "".join(map(sse, events + writer.add(text)))


def last_chunks(req: Request, seqs: list[Sequence], meta: dict, tokenizer) -> str:
    """The end of the items, then response.completed (or response.incomplete) with the whole response."""
    writer = output(req, meta)
    events = writer.finish(seqs[0])
    response = writer.response(seqs[0])
    events.append(writer.event(f"response.{response['status']}", response=response))
    return "".join(map(sse, events))


def error(err: RequestError) -> dict:
    return openai_api.error(err)


def error_tail(err: RequestError, req: Request, meta: dict) -> str:
    """response.failed, with the items so far and the error."""
    writer = output(req, meta)
    response = writer.response() | {"status": "failed", "output": json_copy(writer.items),
                                    "error": {"code": "server_error", "message": err.message}}
    return sse(writer.event("response.failed", response=response))
