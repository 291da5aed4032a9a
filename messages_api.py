"""Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens. A request's
system prompt, messages (text, tool_use and tool_result blocks) and tools become the chat
Request that /v1/chat/completions makes (so the prompt is rendered by chat_format, and
tools and forced calls are enforced as there); its answers take Anthropic's shapes: a
message with content blocks, or the stream's named events; errors Anthropic's error shape."""

import json

import api
import chat_format
import constraint_fields
import openai_api
import tool_calls
from api import Defaults, Limits, Request, RequestError
from sequence import Sequence
from structured import Constraint

FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "tools", "tool_choice",
          "metadata", "output_config", "cache_control", "service_tier"} | set(api.SAMPLING_FIELDS) - {"stop"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "output_config", "cache_control"}
# Accepted only at these values: what they would change is not implemented
NEUTRAL = {"thinking": ({"type": "disabled"},), "speed": ("standard",), "container": (), "inference_geo": (),
           "mcp_servers": ([],)}
BLOCKS = {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use"}}  # the content blocks of each role
BLOCK_KEYS = {"text": ({"type", "text"}, {"cache_control", "citations"}),
              "tool_use": ({"type", "id", "name", "input"}, {"cache_control"}),
              "tool_result": ({"type", "tool_use_id"}, {"content", "is_error", "cache_control"})}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {"type": "tool", "name"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def parse(body, model_name: str, limits: Limits, defaults: Defaults) -> Request:
    """Its constraint is compiled later (constraint_fields.compile_constraints)."""
    check_object(body)
    api.check_fields(body, FIELDS, NEUTRAL)
    api.check_model(body, model_name, required=True)
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens is required", "max_tokens")
    req = Request("messages", chat=True, input_field="messages")
    req.inputs = [dialog(body, limits)]
    req.max_new_tokens = api.get_int(body, "max_tokens", 1, limits.max_new_tokens)
    req.sampling = {"logprobs": False, "top_logprobs": 0, "echo": False, "constraint": None} \
        | api.sampling_fields(body, defaults, top_p="top_p") | {"stop": api.get_stop(body, "stop_sequences")}
    req.stream = api.get_bool(body, "stream")
    format_constraint = output_format(body.get("output_config"), req.to_compile)
    client_tools(req, body)
    if format_constraint is not None:
        if req.sampling["constraint"] is not None:
            raise RequestError("a tool_choice of type any or tool forces a tool call; it cannot take an "
                               "output_config.format as well", "tool_choice")
        req.sampling["constraint"] = format_constraint
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, (str, type(None)))
                                                                         for v in metadata.values())):
        raise RequestError("metadata must be an object such as {\"user_id\": \"...\"}", "metadata")
    return req


def check_object(body):
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {api.type_name(body)}", None)


def dialog(body: dict, limits: Limits) -> list:
    """system and messages as the chat route's messages: an assistant's tool_use blocks as its
    tool_calls, a user's tool_result blocks as tool messages (before its text, if any); the
    text blocks of one message joined by blank lines."""
    messages = [] if body.get("system") is None else [{"role": "system", "content": text_of(body["system"], "system")}]
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise RequestError("messages must be a non-empty list of messages", "messages")
    for i, msg in enumerate(given):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if not isinstance(role, str) or role not in BLOCKS or set(msg) != {"role", "content"}:
            raise RequestError(f'{where} must be an object with "role" (user or assistant) and "content", and '
                               "nothing else", "messages")
        content = msg["content"]
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks", "messages")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            here = f"{where}.content[{j}]"
            kind = api.kind_of(block)
            if kind not in BLOCKS[role]:
                raise RequestError(f"{here} must be a {' or '.join(sorted(BLOCKS[role]))} block in a {role} message"
                                   + (f", got type {json.dumps(kind)}" if kind else ""), "messages")
            try:
                tool_calls.check_keys(block, here, *BLOCK_KEYS[kind])
            except ValueError as e:
                raise RequestError(str(e), "messages") from None
            if kind == "text":
                texts.append(text_of([block], here))
            elif kind == "tool_use":
                if not isinstance(block["input"], dict):
                    raise RequestError(f"{here}.input must be an object", "messages")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            else:
                if not isinstance(block.get("is_error", False), bool):
                    raise RequestError(f"{here}.is_error must be true or false", "messages")
                result = text_of(block.get("content", ""), f"{here}.content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": f"Error: {result}" if block.get("is_error") else result})
        if role == "assistant":
            messages.append({"role": role, "content": "\n\n".join(texts) if texts or not calls else None}
                            | ({"tool_calls": calls} if calls else {}))
        else:
            messages += results + ([{"role": role, "content": "\n\n".join(texts)}] if texts or not results else [])
    return api.get_dialog({"messages": messages}, "messages", limits)


def text_of(content, where: str) -> str:
    """A string, or a list of text blocks, as one string (blocks joined by blank lines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                                and isinstance(b.get("text"), str) for b in content):
        raise RequestError(f"{where} must be a string or a list of text blocks; other blocks are not supported",
                           where.partition("[")[0].partition(".")[0])
    return "\n\n".join(b["text"] for b in content)


def output_format(config, to_compile: list) -> Constraint | None:
    """output_config.format: {"type": "json_schema", "schema": {...}}, enforced."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"} or config.get("effort") is not None:
        raise RequestError('output_config takes "format" alone ("effort" is not supported)', "output_config")
    spec = config.get("format")
    if spec is None:
        return None
    if not (isinstance(spec, dict) and spec.get("type") == "json_schema" and spec.get("schema") is not None):
        raise RequestError('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config")
    constraint = Constraint("json_schema", spec["schema"])
    problem = f"output_config.format.schema {constraint_fields.PROBLEM['json_schema']}"
    constraint_fields.check_compiles(constraint, to_compile, problem, "output_config")
    return constraint


def client_tools(req: Request, body: dict):
    """req's tools and the constraint of a forced call, as the chat route sets them, from
    Anthropic's client tools ({"name", "input_schema", "description"?}) and tool_choice
    (auto, any, tool with its name, none; disable_parallel_tool_use)."""
    given = body.get("tools") or []
    if not isinstance(given, list):
        raise RequestError("tools must be a list of tools", "tools")
    chat_tools = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise RequestError(f'tools[{i}] must be a client tool ({{"name", "input_schema", "description"}}); '
                               "server tools are not supported", "tools")
        try:
            tool_calls.check_keys(tool, f"tools[{i}]", {"name", "input_schema"},
                             {"type", "description", "cache_control", "strict"})
        except ValueError as e:
            raise RequestError(str(e), "tools") from None
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        chat_tools.append({"type": "function", "function": function | {
            k: tool[k] for k in ("description", "strict") if tool.get(k) is not None}})
    api.check_text(chat_tools, "tools", "tools")
    choice = body.get("tool_choice")
    chat_body = {"tools": chat_tools, "tool_choice": None}
    if choice is not None:
        kind = api.kind_of(choice)
        keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
        if (kind not in TOOL_CHOICES and kind != "tool") or set(choice) - keys or (kind == "tool") != ("name" in choice):
            raise RequestError('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                               '{"type": "tool", "name": ...} (with "disable_parallel_tool_use")', "tool_choice")
        chat_body["tool_choice"] = TOOL_CHOICES.get(kind) or {"type": "function", "function": {"name": choice["name"]}}
        if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
            raise RequestError("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
    try:
        openai_api.tool_call_constraint(req, chat_body)
    except RequestError as e:
        message = e.message.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise RequestError(message, e.param) from None


def count_tokens(body, tokenizer, model_name: str, limits: Limits) -> dict:
    """/v1/messages/count_tokens: the tokens of the prompt that /v1/messages makes of body."""
    check_object(body)
    api.check_fields(body, COUNT_FIELDS, NEUTRAL)
    api.check_model(body, model_name, required=True)
    req = Request("messages", chat=True, input_field="messages", sampling={"constraint": None})
    messages = api.check_text(dialog(body, limits), "messages", "messages")
    client_tools(req, body)
    try:
        return {"input_tokens": len(chat_format.encode_dialog(tokenizer, messages, req.tools or None))}
    except ValueError as e:  # a rule of the chat format
        raise RequestError(str(e).replace("dialog", "messages"), "messages") from None


# --- answers: one writer for the whole answer and for the stream -------------------------

class Content:
    """A message's content blocks as its text arrives (text, and tool_use blocks:
    tool_calls.ToolCallStream tells calls from text), and the stream events that tell of them."""

    def __init__(self, req: Request):
        self.blocks: list[dict] = []
        self.open = False  # the last block is still being written
        self.arguments = ""  # the JSON text of the tool_use block being written
        self.calls = tool_calls.ToolCallStream(req.tools) if req.tools else None

    def add(self, text: str) -> list[dict]:
        return self.follow(self.calls.add(text) if self.calls else [{"content": text}] if text else [])

    def finish(self) -> list[dict]:
        return (self.follow(self.calls.finish()) if self.calls else []) + self.close()

    def follow(self, deltas: list[dict]) -> list[dict]:
        """Events for ToolCallStream's deltas: text, a call's head, a piece of its arguments."""
        events = []
        for delta in deltas:
            if "content" in delta:
                if not (self.open and self.blocks[-1]["type"] == "text"):
                    events += self.close() + self.begin({"type": "text", "text": ""})
                self.blocks[-1]["text"] += delta["content"]
                events.append(self.delta({"type": "text_delta", "text": delta["content"]}))
                continue
            call = delta["tool_calls"][0]
            if "id" in call:  # a new call
                events += self.close() + self.begin({"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}",
                                                     "name": call["function"]["name"], "input": {}})
                self.arguments = ""
            else:
                self.arguments += call["function"]["arguments"]
                events.append(self.delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return events

    def begin(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.open = True
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def close(self) -> list[dict]:
        """The end of the block being written, if any; a tool_use block gets its input (an
        object; {} where max_tokens cut its JSON short)."""
        if not self.open:
            return []
        self.open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            arguments = tool_calls.json_object(self.arguments)
            block["input"] = arguments if isinstance(arguments, dict) else {}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def stop_reason(seq: Sequence, content: Content) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished message."""
    if seq.finish_reason == "length":
        return "max_tokens", None
    if seq.stop_string is not None:
        return "stop_sequence", seq.stop_string
    if any(block["type"] == "tool_use" for block in content.blocks):
        return "tool_use", None
    return "end_turn", None


def message(meta: dict, blocks: list, reason: tuple, usage: dict) -> dict:
    return {"id": meta["id"], "type": "message", "role": "assistant", "model": meta["model"], "content": blocks,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}


def answer(req: Request, seqs: list[Sequence], tokenizer, meta: dict) -> dict:
    seq, content = seqs[0], Content(req)
    content.add(seq.text)
    content.finish()
    usage = {"input_tokens": len(seq.prompt_tokens), "output_tokens": len(seq.tokens)}
    return message(meta, content.blocks, stop_reason(seq, content), usage)


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


STREAM_TYPE = "text/event-stream"
CHOICE_ERRORS = False  # a request whose grammar broke fails: no finish reason says so


def content_of(req: Request) -> Content:
    """The request's Content, made at its first piece."""
    if "content" not in req.state:
        req.state["content"] = Content(req)
    return req.state["content"]


def chunk(req: Request, meta: dict, index: int, text: str, first: bool) -> str:
    events = []
    if first:
        usage = {"input_tokens": meta["prompt_tokens"], "output_tokens": 0}
        events = [{"type": "message_start", "message": message(meta, [], (None, None), usage)}, {"type": "ping"}]
    return "".join(map(sse, events + content_of(req).add(text)))


def last_chunks(req: Request, seqs: list[Sequence], meta: dict, tokenizer) -> str:
    """The end of the blocks, message_delta (stop_reason, usage) and message_stop."""
    content = content_of(req)
    events = content.finish()
    reason, sequence = stop_reason(seqs[0], content)
    events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": len(seqs[0].tokens)}}, {"type": "message_stop"}]
    return "".join(map(sse, events))


def error(err: RequestError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_tail(err: RequestError, req: Request, meta: dict) -> str:
    """An error event ends a stream that fails after it began."""
    return sse(error(err))
