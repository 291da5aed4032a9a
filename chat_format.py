"""Chat prompts: the tokens that ask a model for the assistant's next message, in the
format its checkpoint was trained with:

- a Hugging Face checkpoint's own chat template (tokenizer_config.json's chat_template, or
  chat_template.jinja), rendered as transformers' apply_chat_template(add_generation_prompt=True)
  renders it, in jinja2's sandbox;
- otherwise Meta's Llama 3 format, for tokenizers that have <|start_header_id|>;
- otherwise Meta's Llama 2 layout ([INST] ... [/INST], <<SYS>>).

Whatever the format, the text of a message never becomes a special token.
"""

import functools
import re
import secrets
from datetime import datetime

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
LLAMA2_ROLES = ("system", "user", "assistant")
LLAMA3_ROLES = ("system", "user", "assistant", "ipython", "tool")  # tool is written as ipython


def format_name(tokenizer) -> str:
    if tokenizer.chat_template:
        return "template"
    return "llama3" if "<|start_header_id|>" in tokenizer.special_tokens else "llama2"


def encode_dialog(tokenizer, dialog) -> list[int]:
    """The prompt tokens for dialog (a list of {"role", "content"} messages). A ValueError
    names the first rule the dialog breaks."""
    check_messages(dialog)
    encode = {"template": encode_with_template, "llama3": encode_llama3, "llama2": encode_llama2}
    return encode[format_name(tokenizer)](tokenizer, dialog)


def check_messages(dialog, roles=None):
    if not isinstance(dialog, list) or not dialog:
        raise ValueError("dialog must be a non-empty list of messages")
    for i, msg in enumerate(dialog):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"dialog[{i}] must be an object with 'role' and 'content'")
        if not isinstance(msg["role"], str) or (roles and msg["role"] not in roles):
            allowed = f"one of {', '.join(roles)}" if roles else "a string"
            raise ValueError(f"dialog[{i}].role must be {allowed}, got {msg['role']!r}")
        if not isinstance(msg["content"], str):
            raise ValueError(f"dialog[{i}].content must be a string")


def check_ends_with_user(dialog, roles=("user",)):
    if dialog[-1]["role"] not in roles:
        raise ValueError(f"the dialog must end with a {' or '.join(roles)} message, not {dialog[-1]['role']!r}")


# --- Llama 2 --------------------------------------------------------------------------------

def validate_llama2(dialog) -> list:
    """Meta's Llama 2 rules: an optional system message first, then user and assistant
    alternating, ending with user; no [INST] or <<SYS>> tags in the text."""
    check_messages(dialog, LLAMA2_ROLES)
    for i, msg in enumerate(dialog):
        for tag in SPECIAL_TAGS:
            if tag in msg["content"]:
                raise ValueError(f"dialog[{i}].content contains the special tag {tag}")
    first = 1 if dialog[0]["role"] == "system" else 0
    for i in range(first, len(dialog)):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if dialog[i]["role"] != expected:
            rule = ("a system message may only come first" if dialog[i]["role"] == "system"
                    else "roles must alternate user/assistant, starting with user")
            raise ValueError(f"dialog[{i}].role is {dialog[i]['role']!r} where {expected!r} was expected: {rule}")
    check_ends_with_user(dialog)
    return dialog


def encode_llama2(tokenizer, dialog) -> list[int]:
    """Meta's Llama 2 layout: a leading system message goes into the first user turn
    between <<SYS>> tags; each finished exchange is BOS [INST] user [/INST] answer EOS, and
    the last user turn is BOS [INST] user [/INST]."""
    dialog = validate_llama2(dialog)
    if dialog[0]["role"] == "system":
        dialog = [{"role": "user", "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}] + dialog[2:]
    tokens = []
    for prompt, answer in zip(dialog[::2], dialog[1::2]):
        tokens += tokenizer.encode(f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} ",
                                   bos=True, eos=True)
    tokens += tokenizer.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", bos=True, eos=False)
    return tokens


# --- Llama 3 --------------------------------------------------------------------------------

def encode_llama3(tokenizer, dialog) -> list[int]:
    """Meta's Llama 3 format: <|begin_of_text|>, then for each message its header
    (<|start_header_id|>role<|end_header_id|>\\n\\n), its stripped content and <|eot_id|>,
    then the assistant's header."""
    check_messages(dialog, LLAMA3_ROLES)
    check_ends_with_user(dialog, ("user", "ipython", "tool"))
    special = tokenizer.special_tokens

    def header(role: str) -> list[int]:
        return ([special["<|start_header_id|>"]] + tokenizer.encode(role, bos=False, eos=False)
                + [special["<|end_header_id|>"]] + tokenizer.encode("\n\n", bos=False, eos=False))

    tokens = [tokenizer.bos_id]
    for msg in dialog:
        role = "ipython" if msg["role"] == "tool" else msg["role"]
        tokens += header(role) + tokenizer.encode(msg["content"].strip(), bos=False, eos=False)
        tokens.append(special["<|eot_id|>"])
    return tokens + header("assistant")


# --- a checkpoint's own template ----------------------------------------------------------

@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """template compiled as transformers compiles chat templates: jinja2's immutable sandbox,
    trim_blocks and lstrip_blocks, loop controls, tojson without HTML escaping,
    raise_exception and strftime_now."""
    import json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def special_token_strings(tokenizer) -> dict:
    """bos_token, eos_token, ... as tokenizer_config.json gives them: what templates read."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer.config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def encode_with_template(tokenizer, dialog) -> list[int]:
    """Render the template and tokenize the result with its special tokens. Special-token
    text inside messages is swapped for a random placeholder before rendering and back after
    the specials are found, so that it is encoded as plain text."""
    import jinja2

    specials = tokenizer.special_tokens
    if specials:
        pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    else:
        pattern = re.compile(r"(?!x)x")  # matches nothing
    nonce, hidden = secrets.token_hex(8), {}

    def hide(m: re.Match) -> str:
        key = f"\ue000{nonce}{len(hidden)}\ue001"
        hidden[key] = m.group(0)
        return key

    messages = [dict(msg, content=pattern.sub(hide, msg["content"])) for msg in dialog]
    try:
        text = compile_template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=True, tools=None, documents=None,
            **special_token_strings(tokenizer))
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the checkpoint's chat template refused the dialog: {e}") from None
    tokens, at = [], 0
    for m in pattern.finditer(text):
        tokens += encode_plain(tokenizer, text[at:m.start()], hidden)
        tokens.append(specials[m.group(0)])
        at = m.end()
    return tokens + encode_plain(tokenizer, text[at:], hidden)


def encode_plain(tokenizer, text: str, hidden: dict) -> list[int]:
    for key, original in hidden.items():
        text = text.replace(key, original)
    return tokenizer.encode(text, bos=False, eos=False) if text else []
