"""Tool calling on /v1/chat/completions (OpenAI's `tools`), for Llama 3.x: a request's tools,
tool_choice and messages' tool_calls checked; the JSON schema that a forced call must
match; and the calls in generated text, in a finished answer or as it streams.

A Llama 3.1+ Instruct model calls a function by answering with JSON, {"name": ...,
"parameters": {...}}, after <|python_tag|> when its system prompt says "Environment:
ipython" (Meta's prompt format, "JSON based tool calling" in
https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/).
Its answer may say "arguments" instead of "parameters", and Llama 3.2 may answer several
calls, separated by ";" or line breaks (as vLLM's llama3_json parser reads them).
"""

import json
import re
import secrets

PYTHON_TAG = "<|python_tag|>"
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters left out
TOOL_CHOICES = ("none", "auto", "required")
JSON_SPACE = " \t\n\r"
SEPARATOR = re.compile(f"[{JSON_SPACE};]*")  # between calls


# --- a request's tools -------------------------------------------------------------------------

def check_tools(tools) -> list[dict]:
    """tools as a request gives them: null, or a list of {"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}} with distinct names and parameters a
    JSON schema of an object. Returns the list ([] for null); a ValueError names the field."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function tools")
    names = set()
    for i, tool in enumerate(tools):
        name = check_tool(tool, f"tools[{i}]")["name"]
        if name in names:
            raise ValueError(f"tools[{i}].function.name: {name!r} is named twice")
        names.add(name)
    return tools


def check_tool(tool, where: str) -> dict:
    """tool's function, if tool is a function tool."""
    check_keys(tool, where, {"type", "function"})
    if tool["type"] != "function":
        raise ValueError(f"{where}.type must be 'function'")
    function = tool["function"]
    check_keys(function, f"{where}.function", {"name"}, {"description", "parameters", "strict"})
    check_name(function["name"], f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f'{where}.function.parameters must be a JSON schema with "type": "object"')
    if not isinstance(function.get("strict", False), bool):
        raise ValueError(f"{where}.function.strict must be true or false")
    return function


def check_keys(value, where: str, required: set, optional: frozenset = frozenset()):
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    missing = sorted(required - set(value))
    if missing:
        raise ValueError(f"{where} needs {missing[0]!r}")
    unknown = sorted(set(value) - required - optional)
    if unknown:
        keys = ", ".join(map(repr, sorted(required | optional)))
        raise ValueError(f"{where} has the key {unknown[0]!r}; it takes {keys}")


def check_name(name, where: str):
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where} must be 1 to 64 letters, digits, '_' or '-'")


def check_tool_choice(tool_choice, tools: list[dict]):
    """tool_choice as a request gives it, against its checked tools: "none", "auto",
    "required", or {"type": "function", "function": {"name"}} naming one of tools. Null is
    OpenAI's default: "auto" with tools, "none" without. Returns the choice; a ValueError
    names the field."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in TOOL_CHOICES:
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    named = (isinstance(tool_choice, dict) and set(tool_choice) == {"type", "function"}
             and tool_choice["type"] == "function" and isinstance(tool_choice["function"], dict)
             and set(tool_choice["function"]) == {"name"} and isinstance(tool_choice["function"]["name"], str))
    if not named:
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    name = tool_choice["function"]["name"]
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among tools")
    return tool_choice


def call_schema(tools: list[dict], tool_choice) -> dict | None:
    """The JSON schema (for structured.Constraint("json_schema", ...)) of the answer that a
    checked tool_choice forces: one call, {"name": the function's name, "parameters": its
    arguments by its schema}, of the named function, or of any of tools for "required";
    None for "none" and "auto", which force nothing. One call even with parallel_tool_calls:
    Llama writes each call as a JSON object of its own, and no one JSON value is several."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return None
    chosen = [tool["function"] for tool in tools
              if tool_choice == "required" or tool["function"]["name"] == tool_choice["function"]["name"]]
    places = [""] if len(chosen) == 1 else [f"/anyOf/{i}" for i in range(len(chosen))]
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "parameters": moved(f.get("parameters", NO_PARAMETERS), f"{place}/properties/parameters")},
        "required": ["name", "parameters"], "additionalProperties": False} for f, place in zip(chosen, places)]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def moved(schema, at: str):
    """schema put at the JSON pointer `at` of another: its references to itself ("#",
    "#/$defs/...", which pydantic's schemas hold) made to point there."""
    if isinstance(schema, list):
        return [moved(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: f"#{at}{value[1:]}" if key == "$ref" and isinstance(value, str) and value.split("/")[0] == "#"
            else moved(value, at) for key, value in schema.items()}


# --- tool calls in messages --------------------------------------------------------------------

def check_tool_calls(calls, where: str):
    """An assistant message's tool_calls: a list of {"id", "type": "function", "function":
    {"name", "arguments": a JSON object as text}}, as OpenAI's answers give them."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        check_keys(call, here, {"id", "type", "function"})
        if not isinstance(call["id"], str):
            raise ValueError(f"{here}.id must be a string")
        if call["type"] != "function":
            raise ValueError(f"{here}.type must be 'function'")
        check_keys(call["function"], f"{here}.function", {"name", "arguments"})
        check_name(call["function"]["name"], f"{here}.function.name")
        if not isinstance(json_object(call["function"]["arguments"]), dict):
            raise ValueError(f"{here}.function.arguments must be a JSON object, as a string")


def json_object(text):
    """The JSON value text holds, or None if it is not a string of JSON."""
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def call_arguments(call: dict) -> dict:
    """A checked call's arguments, as an object."""
    return json.loads(call["function"]["arguments"])


# --- tool calls in generated text ---------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """A finished answer's (content, tool_calls): its calls of tools in OpenAI's shape ({"id",
    "type": "function", "function": {"name", "arguments": JSON text}}), and the text that is
    not a call: all of it when it does not begin with a call, what follows the calls when it
    does (None if nothing does). What ToolCallStream's deltas add up to."""
    stream = ToolCallStream(tools)
    deltas = stream.add(text) + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    return (content or None) if stream.calls else content, stream.calls


class ToolCallStream:
    """Tool calls told apart from content as the text of an answer arrives. add(piece) for
    each piece, then finish(); each returns chat.completion.chunk deltas: {"content": text},
    or {"tool_calls": [...]} with, for each call, first its index, id, type and name (and
    arguments ""), then its arguments.

    Text that may begin a call (<|python_tag|>, then "{" after blanks) is held until it
    tells: an object is a call once it closes and is one (call_of: a tool's "name", an object
    of "parameters" or "arguments", in any order), whole, so that arguments that are not
    JSON, or cut off by max_tokens, are never a call; it is content otherwise. Other text is
    content, at once. After the calls (separated by blanks or ";"), text that is not another
    call is content too. The deltas add up to the same calls and content however the text is
    cut."""

    def __init__(self, tools: list[dict]):
        self.names = {tool["function"]["name"] for tool in tools}
        self.text, self.at = "", 0  # all the text so far; where its undecided part begins
        self.content_from = 0  # where content begins if the text is no call (past <|python_tag|>)
        self.calls: list[dict] = []
        self.extent = None  # the JSON object being read
        self.state = self.start

    def add(self, piece: str) -> list[dict]:
        self.text += piece
        return self.run(final=False)

    def finish(self) -> list[dict]:
        return self.run(final=True)

    def run(self, final: bool) -> list[dict]:
        """Each state reads from self.at: deltas when it moves on, None when it needs more text."""
        deltas = []
        while (out := self.state(final)) is not None:
            deltas += out
        return deltas

    # --- states ---

    def start(self, final):
        rest = self.text[self.at:]
        if rest.startswith(PYTHON_TAG):
            self.at = self.content_from = len(PYTHON_TAG)
        elif PYTHON_TAG.startswith(rest) and not final:
            return None
        self.state = self.lead
        return []

    def lead(self, final):
        """Before the first call: blanks, then "{", or content."""
        rest = self.text[self.at:]
        body = rest.lstrip(JSON_SPACE)
        if not body and not final:
            return None
        if body.startswith("{"):
            return self.begin_object(self.at + len(rest) - len(body))
        return self.to_content(self.content_from)

    def object(self, final):
        """An object that may be a call, told once it closes (the text ending inside it: not one)."""
        end = self.extent.end(self.text)
        if end is None:
            return self.not_a_call() if final else None
        call = self.call_of(self.text[self.at:end])
        if call is None:
            return self.not_a_call()
        self.at = end
        self.state = self.between
        return [self.new_call(call[0]), self.arguments_delta(call[1])]

    def between(self, final):
        """After a call: blanks and ";", then another call or content."""
        at = SEPARATOR.match(self.text, self.at).end()
        if at == len(self.text):
            return None
        if self.text[at] == "{":
            return self.begin_object(at)
        return self.to_content(at)

    def content(self, final):
        piece, self.at = self.text[self.at:], len(self.text)
        return [{"content": piece}] if piece else None

    # --- moves ---

    def begin_object(self, at: int) -> list:
        self.at, self.extent, self.state = at, Extent(at), self.object
        return []

    def not_a_call(self) -> list:
        """The object is not a call: content from where it began, or from the text's start."""
        return self.to_content(self.at if self.calls else self.content_from)

    def to_content(self, at: int) -> list:
        self.at, self.state = at, self.content
        return []

    def call_of(self, text: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) if text is a JSON object of a tool's "name", an
        object of "parameters" or "arguments", and at most "type": "function" besides."""
        value = json_object(text)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in self.names:
            return None
        arguments = [value[key] for key in ("parameters", "arguments") if key in value]
        if (len(arguments) != 1 or not isinstance(arguments[0], dict) or value.get("type", "function") != "function"
                or set(value) - {"name", "parameters", "arguments", "type"}):
            return None
        return value["name"], json.dumps(arguments[0], ensure_ascii=False)

    def new_call(self, name: str) -> dict:
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def arguments_delta(self, piece: str) -> dict:
        self.calls[-1]["function"]["arguments"] += piece
        return {"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]}


class Extent:
    """Where the JSON object that begins at text[start] ("{") ends, found as the text grows."""

    def __init__(self, start: int):
        self.pos, self.depth, self.string, self.escape = start, 0, False, False

    def end(self, text: str) -> int | None:
        """The index just past the object's "}", or None while text ends inside it."""
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.string:
                self.escape, self.string = (False, True) if self.escape else (c == "\\", c != '"')
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None
