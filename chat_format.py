"""Chat prompts: the tokens that ask a model for the assistant's next message, in the
format its checkpoint was trained with:

- a Hugging Face checkpoint's own chat template (tokenizer_config.json's chat_template, or
  chat_template.jinja), rendered as transformers' apply_chat_template(add_generation_prompt=True)
  renders it, in jinja2's sandbox;
- otherwise Meta's Llama 3 format, for tokenizers that have <|start_header_id|>;
- otherwise Meta's Llama 2 layout ([INST] ... [/INST], <<SYS>>).

Whatever the format, the text of a message never becomes a special token, and a role is one
of ROLES; a checkpoint's template renders within bounds of size, work and time.
"""

import functools
import re
import secrets

import jinja2

from chat_template import TemplateLimit, compile_template

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
ROLES = ("system", "user", "assistant", "ipython", "tool")  # all a request may give; tool is Llama 3's ipython
LLAMA2_ROLES = ROLES[:3]


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


def check_messages(dialog, roles=ROLES):
    """Messages of a role from roles and a string content, nothing else: a role, like any
    other key, may go into the prompt as it is, so it can only be one the format knows."""
    if not isinstance(dialog, list) or not dialog:
        raise ValueError("dialog must be a non-empty list of messages")
    for i, msg in enumerate(dialog):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"dialog[{i}] must be an object with 'role' and 'content'")
        unknown = sorted(map(str, set(msg) - {"role", "content"}))
        if unknown:
            raise ValueError(f"dialog[{i}] has the key {unknown[0]!r}; a message has only 'role' and 'content'")
        if not isinstance(msg["role"], str) or msg["role"] not in roles:
            raise ValueError(f"dialog[{i}].role must be one of {', '.join(roles)}, got {msg['role']!r}")
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
    check_messages(dialog)
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
    """Render the template and tokenize the result with its special tokens. The template
    gets each message's role (one of ROLES) and content, nothing else, and the content's
    special-token text as placeholders (Hider), encoded as plain text once the specials
    are found. Whatever goes wrong in the template is a ValueError that says what."""
    specials = tokenizer.special_tokens
    hider = Hider(specials)
    messages = [{"role": msg["role"], "content": hider.hide(msg["content"])} for msg in dialog]
    try:
        text = compile_template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=True, tools=None, documents=None,
            **special_token_strings(tokenizer))
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the checkpoint's chat template does not compile: {e}") from None
    except jinja2.TemplateError as e:  # raise_exception, or what the sandbox forbids
        raise ValueError(f"the checkpoint's chat template refused the dialog: {e}") from None
    except TemplateLimit as e:
        raise ValueError(f"the checkpoint's chat template went beyond a limit: {e}") from None
    except Exception as e:  # the template's bug (OverflowError, RecursionError, TypeError, MemoryError, ...)
        raise ValueError(f"the checkpoint's chat template failed: {type(e).__name__}: {e}") from None
    tokens, at = [], 0
    for m in hider.pattern.finditer(text):
        tokens += encode_plain(tokenizer, hider.restore(text[at:m.start()]))
        tokens.append(specials[m.group(0)])
        at = m.end()
    return tokens + encode_plain(tokenizer, hider.restore(text[at:]))


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
    """Swaps the special-token text of messages for placeholders (private-use characters around
    a random nonce, which nothing a template writes next to them completes into a special
    token) and back. A message's start that would end a special token begun just before it
    (by the previous message's end, after a template trims the whitespace between) is hidden
    too."""

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

    def restore(self, text: str) -> str:
        return self.keys.sub(lambda m: self.hidden[int(m.group(1))], text)  # in one pass, however many
