"""OpenAI-compatible schema: /v1/completions, /v1/chat/completions and /v1/models, and
vLLM's tokenizer routes (tokenizer_info, tokenize, detokenize), reached through
TorchServe's url_path (/predictions/llama/1.0/...). Requests become the same Request as
the native API; answers, stream chunks (server-sent events) and errors take OpenAI's (and
vLLM's) shapes."""

import json

import api
import chat_format
import constraint_fields
import tool_calls
from api import MAX_TOP_LOGPROBS, Defaults, Limits, Request, RequestError
from sequence import Sequence
from structured import Constraint
from tokenizer import TextStream

# Accepted only at their neutral value: anything else is refused rather than ignored.
# best_of (generate several, answer the most probable) is not implemented: ask for n instead.
NEUTRAL = {"best_of": (None, 1), "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none")}
COMPLETIONS_NEUTRAL = {"tools": (None, []), "tool_choice": (None, "none")}  # tools are for chat
KEPT_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}  # a message's keys beyond role and content
CONSTRAINT_FIELDS = ("response_format", "structured_outputs") + constraint_fields.GUIDED_FIELDS  # OpenAI's, vLLM's, vLLM's older


def parse(route: str, body, model_name: str, limits: Limits, defaults: Defaults) -> Request:
    """Its constraint is compiled later (constraint_fields.compile_constraints)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {api.type_name(body)}", None)
    api.check_model(body, model_name)
    for name, allowed in (NEUTRAL if route == "chat" else NEUTRAL | COMPLETIONS_NEUTRAL).items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"{name}={json.dumps(body[name])} is not supported (only {allowed[-1]!r})", name)
    req = Request(route, chat=route == "chat", input_field="messages" if route == "chat" else "prompt")
    if req.chat:
        req.inputs = [chat_messages(body, limits)]
        req.max_new_tokens = max_tokens(body, limits, "max_completion_tokens")
        logprobs = api.get_bool(body, "logprobs")
        req.sampling = {"logprobs": logprobs, "top_logprobs": api.get_top_logprobs(body, logprobs, "logprobs: true"),
                        "echo": False}
    else:
        if "prompt" not in body:
            raise RequestError("prompt is required", "prompt")
        req.inputs, req.batched = api.get_prompts(body, "prompt", limits, token_ids=True)
        echo = api.get_bool(body, "echo")
        req.max_new_tokens = max_tokens(body, limits, lo=0)
        if req.max_new_tokens == 0 and not echo:
            raise RequestError("max_tokens 0 generates nothing; it is for scoring the prompt, with echo: true",
                               "max_tokens")
        logprobs = api.get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)  # how many alternatives
        req.sampling = {"logprobs": logprobs is not None, "top_logprobs": logprobs or 0, "echo": echo}
    req.n = api.get_n(body, len(req.inputs), limits)
    req.sampling |= api.sampling_fields(body, defaults, top_p="top_p")
    req.stream = api.get_bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    req.include_usage = api.get_bool(options, "include_usage")
    if req.stream and req.sampling["logprobs"]:
        raise RequestError("logprobs are not supported with stream", "logprobs")
    req.sampling["constraint"] = constraint_fields.get_constraint(body, CONSTRAINT_FIELDS, req.to_compile)
    if req.chat:
        tool_call_constraint(req, body)
    return req


def tool_call_constraint(req: Request, body: dict):
    """req's tools, and the constraint of a forced call (tool_choice required or a named
    function): the answer is one call whose arguments match the function's parameters."""
    try:
        req.tools = tool_calls.check_tools(body.get("tools"))
    except ValueError as e:
        raise RequestError(str(e), "tools") from None
    try:
        choice = tool_calls.check_tool_choice(body.get("tool_choice"), req.tools)
    except ValueError as e:
        raise RequestError(str(e), "tool_choice") from None
    api.get_bool(body, "parallel_tool_calls", True)  # checked; a forced answer is one call either way
    if choice == "none":
        req.tools = []  # neither shown to the model nor read in its answer
    schema = tool_calls.call_schema(req.tools, choice)
    if schema is None:
        return
    if req.sampling["constraint"] is not None:
        raise RequestError(f"tool_choice {json.dumps(body['tool_choice'])} constrains the answer to a call; "
                           "it cannot take a response_format or structured_outputs as well", "tool_choice")
    req.sampling["constraint"] = constraint = Constraint("json_schema", schema)
    constraint_fields.check_compiles(constraint, req.to_compile, "the parameters of the tools cannot be enforced", "tools")


def max_tokens(body: dict, limits: Limits, alias: str | None = None, lo: int = 1) -> int | None:
    name = alias if alias and body.get(alias) is not None else "max_tokens"
    return api.get_int(body, name, lo, limits.max_new_tokens)


def chat_messages(body: dict, limits: Limits) -> list:
    """messages with OpenAI's content forms (a string, or a list of text parts) as strings."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", "messages")
    flat = []
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and isinstance(msg.get("content"), list):
            parts = msg["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
            msg = msg | {"content": "".join(p["text"] for p in parts)}
        if isinstance(msg, dict):  # OpenAI's other optional keys dropped
            kept = KEPT_KEYS.get(msg.get("role"), ()) if isinstance(msg.get("role"), str) else ()
            msg = {k: msg[k] for k in ("role", "content", *kept) if k in msg}
        flat.append(msg)
    return api.get_dialog({"messages": flat}, "messages", limits)


# --- answers ---------------------------------------------------------------------------

def usage(req: Request, seqs: list[Sequence]) -> dict:
    """Token counts; completion_tokens counts every token the choices return: a completion's
    end with the stop id that ended it (as vLLM's do), a chat message's do not (as OpenAI's)."""
    prompt = sum(len(s.prompt_tokens) for s in seqs[::req.n])  # each prompt once, whatever n
    completion = sum(len(s.tokens if req.chat else s.sampled) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(req: Request, meta: dict, chunk: bool = False) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}


def completion_logprobs(seq: Sequence, tokenizer, prompt: str) -> dict:
    """OpenAI's legacy logprobs. With echo, the prompt's tokens first (the first has no
    logprob); then every sampled token, the stop id that ended the sequence included (as vLLM
    returns it: it has no text). top_logprobs: at each position the most probable tokens and
    the chosen one; text_offset: where each token's text starts in the choice's text
    (prompt: the echoed prompt, or "")."""
    tokens, values, tops, offsets = [], [], [], []
    if seq.params.echo:
        tokens = list(seq.prompt_tokens)
        values = [None] + seq.prompt_logprobs[1:]
        tops = [None] + seq.prompt_top_logprobs[1:]
        offsets = [min(at, len(prompt)) for at in text_offsets(tokenizer, seq.prompt_tokens)]
    tokens += seq.sampled
    values += seq.logprobs
    tops += seq.top_logprobs
    offsets += [len(prompt) + min(at, len(seq.text)) for at in seq.text_offsets]  # text may end at a stop string
    top_logprobs = [None if top is None else top_dict(tokenizer, top + [(t, v)]) for top, t, v in zip(tops, tokens, values)]
    return {"tokens": [tokenizer.token_str(t) for t in tokens], "token_logprobs": values,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def top_dict(tokenizer, pairs: list) -> dict:
    """{token text: logprob} from (id, logprob) pairs, most probable first; of two tokens with
    the same text the first one stays."""
    out = {}
    for token, value in pairs:
        out.setdefault(tokenizer.token_str(token), value)
    return out


def text_offsets(tokenizer, tokens: list[int]) -> list[int]:
    """Where each token's text starts in the text the tokens decode to."""
    stream, at, offsets = TextStream(tokenizer, []), 0, []
    for token in tokens:
        offsets.append(at)
        at += len(stream.add(token))
    return offsets


def chat_logprobs(seq: Sequence, tokenizer) -> dict:
    """OpenAI's chat logprobs: the message's tokens, each with its top_logprobs alternatives."""
    def entry(token: int, value: float) -> dict:
        return {"token": tokenizer.token_str(token), "logprob": value, "bytes": list(tokenizer.token_bytes(token))}

    n = len(seq.tokens)
    return {"content": [entry(token, value) | {"top_logprobs": [entry(*alt) for alt in top]}
                        for token, value, top in zip(seq.tokens, seq.logprobs[:n], seq.top_logprobs[:n])]}


def answer(req: Request, seqs: list[Sequence], tokenizer, meta: dict) -> dict:
    choices = []
    for k, seq in enumerate(seqs):  # choice k answers input k // n, as vLLM numbers them
        choice = {"index": k, "finish_reason": seq.finish_reason, "logprobs": None}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": seq.text}
            if req.tools:
                content, calls = tool_calls.parse_tool_calls(seq.text, req.tools)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice["finish_reason"] = tool_calls_finish(seq)
            if seq.params.logprobs:
                choice["logprobs"] = chat_logprobs(seq, tokenizer)
        else:
            prompt = req.texts[k // req.n] if seq.params.echo else ""
            choice["text"] = prompt + seq.text
            if seq.params.logprobs:
                choice["logprobs"] = completion_logprobs(seq, tokenizer, prompt)
        choices.append(choice)
    return envelope(req, meta) | {"choices": choices, "usage": usage(req, seqs)}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def tool_calls_finish(seq: Sequence) -> str:
    """A choice that called tools: "tool_calls", unless max_tokens cut it ("length")."""
    return "tool_calls" if seq.finish_reason == "stop" else seq.finish_reason


def chunk(req: Request, meta: dict, index: int, text: str, first: bool, finish_reason: str | None = None) -> str:
    if req.tools:
        return tool_chunks(req, meta, index, tool_stream(req, index).add(text), first, finish_reason)
    if req.chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        choice = {"index": index, "delta": delta}
    else:
        if first and req.sampling.get("echo"):
            text = req.texts[index // req.n] + text
        choice = {"index": index, "text": text}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    return sse(envelope(req, meta, chunk=True) | {"choices": [choice]})


STREAM_TYPE = "text/event-stream"
CHOICE_ERRORS = True  # a choice whose grammar broke ends with finish_reason "error"


def tool_stream(req: Request, index: int) -> tool_calls.ToolCallStream:
    """Choice index's ToolCallStream, made at its first piece."""
    if index not in req.tool_streams:
        req.tool_streams[index] = tool_calls.ToolCallStream(req.tools)
    return req.tool_streams[index]


def tool_chunks(req: Request, meta: dict, index: int, deltas: list[dict], first: bool, finish_reason: str | None) -> str:
    """A chat choice with tools: one chunk per delta of its ToolCallStream (content, or a
    call's head or a piece of its arguments); the first carries the role."""
    if first:
        deltas = [{"role": "assistant"} | (deltas[0] if deltas else {"content": ""})] + deltas[1:]
    if finish_reason is not None:
        deltas = deltas + [{}]
    out = ""
    for k, delta in enumerate(deltas):
        last = k == len(deltas) - 1
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason if last else None}
        out += sse(envelope(req, meta, chunk=True) | {"choices": [choice]})
    return out


def last_chunks(req: Request, seqs: list[Sequence], meta: dict, tokenizer) -> str:
    """Each choice's finish_reason (after what a tool-call stream held back), the usage when
    asked for, and [DONE]."""
    out = ""
    for i, s in enumerate(seqs):
        if req.tools:
            stream = tool_stream(req, i)
            deltas = stream.finish()
            out += tool_chunks(req, meta, i, deltas, False, tool_calls_finish(s) if stream.calls else s.finish_reason)
        else:
            out += chunk(req, meta, i, "", False, s.finish_reason)
    if req.include_usage:
        out += sse(envelope(req, meta, chunk=True) | {"choices": [], "usage": usage(req, seqs)})
    return out + "data: [DONE]\n\n"


def error(err: RequestError) -> dict:
    kind = "server_error" if err.status >= 500 else "NotFoundError" if err.status == 404 else "invalid_request_error"
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.status}}


def error_tail(err: RequestError, req: Request, meta: dict) -> str:
    """The end of a stream that fails after it began: an error event, then [DONE]."""
    return sse(error(err)) + "data: [DONE]\n\n"


def models(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "torchserve"}]}


# --- vLLM's tokenizer routes (lm-evaluation-harness's remote tokenizer reads them) ---------

def tokenizer_info(tokenizer, max_seq_len: int) -> dict:
    def text(token: int) -> str | None:
        return tokenizer.token_str(token) if token >= 0 else None

    info = {"tokenizer_class": type(tokenizer).__name__, "bos_token": text(tokenizer.bos_id),
            "eos_token": text(tokenizer.eos_id), "pad_token": text(tokenizer.pad_id),
            "model_max_length": max_seq_len}
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def tokenize(body, tokenizer, max_seq_len: int, limits: Limits) -> dict:
    """The tokens the completion and chat routes make of a prompt or of messages.
    add_special_tokens (prompt: true by default) adds the BOS token; with messages (false by
    default) it adds one before what the chat format gives, as vLLM does."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {api.type_name(body)}", None)
    given = [k for k in ("prompt", "messages") if k in body]
    if len(given) != 1:
        raise RequestError("give exactly one of prompt or messages", "prompt")
    add_special = api.get_bool(body, "add_special_tokens", default=given[0] == "prompt")
    if given[0] == "prompt":
        if not isinstance(body["prompt"], str):
            raise RequestError(f"prompt must be a string, got {api.type_name(body['prompt'])}", "prompt")
        tokens = tokenizer.encode(api.check_text(body["prompt"], "prompt", "prompt"), bos=add_special, eos=False)
    else:
        dialog = api.check_text(chat_messages(body, limits), "messages", "messages")
        try:
            bos = [tokenizer.bos_id] if add_special and tokenizer.bos_id >= 0 else []
            tokens = bos + chat_format.encode_dialog(tokenizer, dialog)
        except ValueError as e:  # a rule of the chat format
            raise RequestError(str(e).replace("dialog", "messages"), "messages") from None
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_seq_len}


def detokenize(body, tokenizer) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {api.type_name(body)}", None)
    if "tokens" not in body:
        raise RequestError("tokens is required", "tokens")
    tokens = body["tokens"]
    if not api.is_id_list(tokens):
        raise RequestError("tokens must be a list of token ids (integers)", "tokens")
    api.check_token_ids(tokens, tokenizer.n_words, "tokens")
    return {"prompt": tokenizer.decode(tokens)}
