"""Chat prompts: the tokens that ask a model for the assistant's next message, in the
format its checkpoint was trained with:

- a Hugging Face checkpoint's own chat template (tokenizer_config.json's chat_template, or
  chat_template.jinja), rendered as transformers' apply_chat_template(add_generation_prompt=True)
  renders it, in jinja2's sandbox;
- otherwise Meta's Llama 3 format, for tokenizers that have <|start_header_id|>;
- otherwise Meta's Llama 2 layout ([INST] ... [/INST], <<SYS>>).

A dialog may carry OpenAI's function tools and tool turns (an assistant's tool_calls, tool
results): a template gets them as transformers' apply_chat_template(tools=...) passes them,
whether it shows them or not (SmolLM2's does not: such a model calls a tool only when
tool_choice forces it); without a template, Meta's Llama 3.1 JSON tool calling (Llama 3) or
a system prompt that describes the functions (Llama 2) lays them out.

Whatever the format, the text of a message never becomes a special token, and a role is one
of ROLES; a checkpoint's template renders within bounds of size, work and time.
"""

import functools
import json
import re
import secrets

import jinja2

from chat_template import TemplateLimit, compile_template
from tool_calls import call_arguments, check_tool_calls, check_tools

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
ROLES = ("system", "user", "assistant", "ipython", "tool")  # all a request may give; tool is Llama 3's ipython
LLAMA2_ROLES = ("system", "user", "assistant", "tool")
ROLE_KEYS = ("role", "content")  # what a message has
KEYS = {"assistant": ROLE_KEYS + ("tool_calls",), "tool": ROLE_KEYS + ("tool_call_id",)}  # and may have, by role


def format_name(tokenizer) -> str:
    return "template" if tokenizer.chat_template else meta_format(tokenizer)


def meta_format(tokenizer) -> str:
    return "llama3" if "<|start_header_id|>" in tokenizer.special_tokens else "llama2"


def encode_dialog(tokenizer, dialog, tools=None) -> list[int]:
    """The prompt tokens for dialog (a list of {"role", "content"} messages, and OpenAI's
    tool_calls and tool_call_id) and tools (OpenAI's function tools, or None). A ValueError
    names the first rule they break."""
    check_messages(dialog)
    tools = check_tools(tools)
    encode = {"template": encode_with_template, "llama3": encode_llama3, "llama2": encode_llama2}
    return encode[format_name(tokenizer)](tokenizer, dialog, tools)


def check_messages(dialog, roles=ROLES):
    """Messages of a role from roles and a string content; an assistant message may carry
    tool_calls too (its content then may be null or left out), a tool message its
    tool_call_id; nothing else: a role, like any other key, may go into the prompt as it is,
    so it can only be one the format knows."""
    if not isinstance(dialog, list) or not dialog:
        raise ValueError("dialog must be a non-empty list of messages")
    for i, msg in enumerate(dialog):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"dialog[{i}] must be an object with 'role' and 'content'")
        if not isinstance(msg["role"], str) or msg["role"] not in roles:
            raise ValueError(f"dialog[{i}].role must be one of {', '.join(roles)}, got {msg['role']!r}")
        keys = KEYS.get(msg["role"], ROLE_KEYS)
        unknown = sorted(map(str, set(msg) - set(keys)))
        if unknown:
            raise ValueError(f"dialog[{i}] has the key {unknown[0]!r}; {msg['role']} messages have only "
                             f"{', '.join(map(repr, keys[:-1]))} and {keys[-1]!r}")
        if msg.get("tool_calls") is not None:
            check_tool_calls(msg["tool_calls"], f"dialog[{i}].tool_calls")
        calls = bool(msg.get("tool_calls"))
        if "content" not in msg and not calls:
            raise ValueError(f"dialog[{i}] must be an object with 'role' and 'content'")
        if not isinstance(msg.get("content"), str) and not (calls and msg.get("content") is None):
            raise ValueError(f"dialog[{i}].content must be a string")
        if not isinstance(msg.get("tool_call_id", ""), str):
            raise ValueError(f"dialog[{i}].tool_call_id must be a string")


def check_ends_with_user(dialog, roles=("user",)):
    if dialog[-1]["role"] not in roles:
        raise ValueError(f"the dialog must end with a {' or '.join(roles)} message, not {dialog[-1]['role']!r}")


def functions_json(tools, indent: int | None = 4) -> str:
    """The tools as JSON, one after another: indented as in Meta's Llama 3.1 examples, or one
    line each (indent None: the Llama 2 prompt, in half the tokens)."""
    return "\n".join(json.dumps(tool, indent=indent, ensure_ascii=False) for tool in tools)


def call_json(call) -> str:
    """A call as Llama writes one: {"name": ..., "parameters": {...}}."""
    return json.dumps({"name": call["function"]["name"], "parameters": call_arguments(call)}, ensure_ascii=False)


# --- Llama 2 --------------------------------------------------------------------------------

def validate_llama2(dialog, tools=()) -> list:
    """Meta's Llama 2 rules: an optional system message first, then user and assistant
    alternating, ending with user; no [INST] or <<SYS>> tags in the text. A run of tool
    messages (the results of the calls before it) takes a user turn."""
    check_messages(dialog, LLAMA2_ROLES)
    fields = [("tools", tools)] + [(f"dialog[{i}].{key}", value) for i, msg in enumerate(dialog)
                                   for key, value in msg.items() if key != "role"]
    for where, value in fields:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)  # no escape makes a tag
        for tag in SPECIAL_TAGS:
            if tag in text:
                raise ValueError(f"{where} contains the special tag {tag}")
    first = 1 if dialog[0]["role"] == "system" else 0
    expected = "user"
    for i in range(first, len(dialog)):
        role = dialog[i]["role"]
        if role == "tool" and i > first and dialog[i - 1]["role"] == "tool":
            continue  # the same turn of results
        if ("user" if role == "tool" else role) != expected:
            rule = ("a system message may only come first" if role == "system"
                    else "roles must alternate user/assistant, starting with user")
            raise ValueError(f"dialog[{i}].role is {role!r} where {expected!r} was expected: {rule}")
        expected = "assistant" if expected == "user" else "user"
    if dialog[-1]["role"] != "tool":  # tool results take the user's turn
        check_ends_with_user(dialog)
    return dialog


# Llama 2 was not trained to call functions: the system prompt says how
LLAMA2_TOOLS = ("You can call these functions, described in JSON:\n{}\n\nTo call functions, answer only with one "
                'JSON object per call, each on a line of its own: {{"name": the function\'s name, "parameters": an '
                "object of its arguments}}. The results come back in the next user message, each after "
                '"Function result:".')


def llama2_exchange(dialog, tools) -> list:
    """The plain Llama 2 exchange that shows a dialog's tools and tool turns: LLAMA2_TOOLS
    after the system message (or as one), an assistant's calls as JSON lines after its
    content, a run of tool messages as one user message of "Function result: ..." paragraphs."""
    system = [dialog[0]["content"]] if dialog[0]["role"] == "system" else []
    if tools:
        system = ["\n\n".join(system + [LLAMA2_TOOLS.format(functions_json(tools, indent=None))])]
    out, previous = [{"role": "system", "content": text} for text in system], None
    for msg in dialog[1:] if dialog[0]["role"] == "system" else dialog:
        if msg["role"] == "tool" and previous == "tool":
            out[-1]["content"] += f"\n\nFunction result: {msg['content']}"
        elif msg["role"] == "tool":
            out.append({"role": "user", "content": f"Function result: {msg['content']}"})
        else:
            calls = [call_json(call) for call in msg.get("tool_calls") or ()]
            out.append({"role": msg["role"], "content": "\n".join(filter(None, [msg.get("content"), *calls]))})
        previous = msg["role"]
    return out


def encode_llama2(tokenizer, dialog, tools=()) -> list[int]:
    """Meta's Llama 2 layout: a leading system message goes into the first user turn
    between <<SYS>> tags; each finished exchange is BOS [INST] user [/INST] answer EOS, and
    the last user turn is BOS [INST] user [/INST]. Tools and tool turns as llama2_exchange
    lays them out."""
    dialog = llama2_exchange(validate_llama2(dialog, tools), tools)
    if dialog[0]["role"] == "system":
        dialog = [{"role": "user", "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}] + dialog[2:]
    tokens = []
    for prompt, answer in zip(dialog[::2], dialog[1::2]):
        tokens += tokenizer.encode(f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} ",
                                   bos=True, eos=True)
    tokens += tokenizer.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", bos=True, eos=False)
    return tokens


# --- Llama 3 --------------------------------------------------------------------------------

# Meta's Llama 3.1 JSON tool calling, the functions in a user message of their own before the
# dialog's: "JSON based tool calling" in https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/
# (llama-models' llama_models/llama3_1/prompt_format.md)
LLAMA3_TOOLS = ("Answer the user's question by making use of the following functions if needed.\n"
                "If none of the function can be used, please say so.\n"
                "Here is a list of functions in JSON format:\n{}\n\nReturn function calls in JSON format.")


def encode_llama3(tokenizer, dialog, tools=()) -> list[int]:
    """Meta's Llama 3 format: <|begin_of_text|>, then for each message its header
    (<|start_header_id|>role<|end_header_id|>\\n\\n), its stripped content and <|eot_id|>,
    then the assistant's header; tool results are ipython messages. With tools, Meta's Llama
    3.1 JSON tool calling (LLAMA3_TOOLS' page): the system message begins with "Environment:
    ipython" (a system message of that alone if the dialog has none), then a user message
    lists the functions. An assistant's calls follow its content: <|python_tag|>, each call's
    {"name": ..., "parameters": ...} (separated by "; "), then <|eom_id|> where "Environment:
    ipython" was said (the call awaits its result), <|eot_id|> otherwise, as the page says; a
    Llama 3.0 tokenizer, which names neither token, gets no tag and <|eot_id|>."""
    check_ends_with_user(dialog, ("user", "ipython", "tool"))
    special = tokenizer.special_tokens

    def header(role: str) -> list[int]:
        return ([special["<|start_header_id|>"]] + encode_plain(tokenizer, role)
                + [special["<|end_header_id|>"]] + encode_plain(tokenizer, "\n\n"))

    def turn(role: str, body: list[int], end: str = "<|eot_id|>") -> list[int]:
        return header(role) + body + [special.get(end, special["<|eot_id|>"])]

    def text(s: str) -> list[int]:
        return encode_plain(tokenizer, s)

    tokens = [tokenizer.bos_id]
    if tools:
        system = dialog[0]["content"].strip() if dialog[0]["role"] == "system" else ""
        tokens += turn("system", text("Environment: ipython" + ("\n\n" + system if system else "")))
        tokens += turn("user", text(LLAMA3_TOOLS.format(functions_json(tools))))
        dialog = dialog[1:] if dialog[0]["role"] == "system" else dialog
    tag = [special["<|python_tag|>"]] if "<|python_tag|>" in special else []
    for msg in dialog:
        content = text((msg.get("content") or "").strip())
        if msg.get("tool_calls"):
            calls = text("; ".join(map(call_json, msg["tool_calls"])))
            tokens += turn("assistant", content + tag + calls, "<|eom_id|>" if tools else "<|eot_id|>")
        else:
            tokens += turn("ipython" if msg["role"] == "tool" else msg["role"], content)
    return tokens + header("assistant")


# --- a checkpoint's own template ----------------------------------------------------------

def special_token_strings(tokenizer) -> dict:
    """bos_token, eos_token, ... as tokenizer_config.json gives them: what templates read."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer.config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def encode_with_template(tokenizer, dialog, tools=()) -> list[int]:
    """Render the template and tokenize the result with its special tokens. The template
    gets the dialog as template_messages gives it and the tools (None if none), the
    special-token text of every string in them as placeholders (Hider), encoded as plain
    text once the specials are found. Whatever goes wrong in the template is a ValueError
    that says what."""
    specials = tokenizer.special_tokens
    hider = Hider(specials)
    messages = hider.hide_all(template_messages(dialog))
    try:
        text = compile_template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=True, tools=hider.hide_all(tools) or None, documents=None,
            **special_token_strings(tokenizer))
    except Exception as e:
        raise template_error(e) from None
    tokens, at = [], 0
    for m in hider.pattern.finditer(text):
        tokens += encode_plain(tokenizer, hider.restore(text[at:m.start()]))
        tokens.append(specials[m.group(0)])
        at = m.end()
    return tokens + encode_plain(tokenizer, hider.restore(text[at:]))


def template_messages(dialog) -> list[dict]:
    """The messages as transformers' callers give them to a template: role and content (a
    null content as ""), an assistant's tool_calls with each call's arguments as an object
    (the JSON text parsed, as vLLM passes them: Llama 3.1's template writes them with
    tojson), a tool message's tool_call_id."""
    messages = []
    for msg in dialog:
        out = {"role": msg["role"], "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            out["tool_calls"] = [call | {"function": call["function"] | {"arguments": call_arguments(call)}}
                                 for call in msg["tool_calls"]]
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        messages.append(out)
    return messages


def template_error(e: Exception) -> ValueError:
    """What went wrong in the checkpoint's template, as a request's error."""
    if isinstance(e, jinja2.TemplateSyntaxError):
        return ValueError(f"the checkpoint's chat template does not compile: {e}")
    if isinstance(e, jinja2.TemplateError):  # raise_exception, or what the sandbox forbids
        return ValueError(f"the checkpoint's chat template refused the dialog: {e}")
    if isinstance(e, TemplateLimit):
        return ValueError(f"the checkpoint's chat template went beyond a limit: {e}")
    # the template's bug (OverflowError, RecursionError, TypeError, MemoryError, ...)
    return ValueError(f"the checkpoint's chat template failed: {type(e).__name__}: {e}")


def encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, bos=False, eos=False) if text else []


SAMPLE_DIALOG = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"},
                 {"role": "user", "content": "Tell me a joke."}]


def check_template(tokenizer):
    """A ValueError naming the problem if the checkpoint has a chat template that cannot
    render a plain exchange (what every chat template renders)."""
    if format_name(tokenizer) == "template":
        encode_with_template(tokenizer, SAMPLE_DIALOG)


@functools.lru_cache(maxsize=8)
def special_tails(specials: frozenset) -> frozenset:
    """Every proper end of a special token's text: '|>', 'id|>', ... 'eot_id|>' of '<|eot_id|>'."""
    return frozenset(s[i:] for s in specials for i in range(1, len(s)))


class Hider:
    """Swaps the special-token text of what a request sends (messages, tools) for placeholders
    (private-use characters around a random nonce, which nothing a template writes next to
    them completes into a special token) and back. A string's start that would end a special
    token begun just before it (by the previous message's end, after a template trims the
    whitespace between) is hidden too."""

    def __init__(self, specials: dict):
        ordered = sorted(specials, key=len, reverse=True)  # the longest first, where one holds another
        self.pattern = re.compile("|".join(map(re.escape, ordered)) if ordered else r"(?!x)x")
        self.tails = special_tails(frozenset(specials))
        self.longest = len(ordered[0]) if ordered else 0
        nonce, self.hidden = secrets.token_hex(8), []
        self.key, self.keys = f"\ue000{nonce}{{}}\ue001", re.compile(f"\ue000{nonce}(\\d+)\ue001")

    def placeholder(self, text: str) -> str:
        self.hidden.append(text)
        return self.key.format(len(self.hidden) - 1)

    def hide(self, content: str) -> str:
        body = content.lstrip()
        head = next((body[:n] for n in range(min(len(body), self.longest - 1), 0, -1) if body[:n] in self.tails), "")
        rest = self.pattern.sub(lambda m: self.placeholder(m.group(0)), body[len(head):])
        return content[:len(content) - len(body)] + (self.placeholder(head) if head else "") + rest

    def hide_all(self, value):
        """value (a JSON value) with every string in it hidden, dict keys too."""
        if isinstance(value, str):
            return self.hide(value)
        if isinstance(value, list):
            return [self.hide_all(item) for item in value]
        if isinstance(value, dict):
            return {self.hide_all(k): self.hide_all(v) for k, v in value.items()}
        return value

    def restore(self, text: str) -> str:
        return self.keys.sub(lambda m: self.hidden[int(m.group(1))], text)  # in one pass, however many
