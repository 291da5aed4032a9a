"""OpenAI-compatible schema: /v1/completions, /v1/chat/completions and /v1/models, reached
through TorchServe's url_path (POST /predictions/llama/1.0/v1/...). Requests become the
same Request as the native API; answers, stream chunks (server-sent events) and errors take
OpenAI's shapes."""

import json

import api
from api import Defaults, Limits, Request, RequestError
from generate import Sequence

# Accepted only at their neutral value: anything else is refused rather than ignored.
NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0, 0.0),
           "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "suffix": (None, ""),
           "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
           "function_call": (None, "none"), "response_format": (None, {"type": "text"})}


def parse(route: str, body, model_name: str, limits: Limits, defaults: Defaults) -> Request:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {api.type_name(body)}", None)
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(f"The model `{model}` does not exist; this server serves `{model_name}`", "model", 404)
    for name, allowed in NEUTRAL.items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"{name}={json.dumps(body[name])} is not supported (only {allowed[-1]!r})", name)
    req = Request(route, chat=route == "chat", input_field="messages" if route == "chat" else "prompt")
    if req.chat:
        req.inputs = [chat_messages(body, limits)]
        req.max_new_tokens = max_tokens(body, limits, "max_completion_tokens")
        req.sampling = {"logprobs": api.get_bool(body, "logprobs"), "echo": False}
        if api.get_int(body, "top_logprobs", 0, 20, 0):
            raise RequestError("top_logprobs is not supported (only 0)", "top_logprobs")
    else:
        if "prompt" not in body:
            raise RequestError("prompt is required", "prompt")
        req.inputs, req.batched = api.get_prompts(body, "prompt", limits)
        req.max_new_tokens = max_tokens(body, limits)
        logprobs = api.get_int(body, "logprobs", 0, 5)
        if logprobs:
            raise RequestError("logprobs above 0 (top alternatives) are not supported; 0 returns the "
                               "chosen tokens' log-probabilities", "logprobs")
        req.sampling = {"logprobs": logprobs == 0, "echo": api.get_bool(body, "echo")}
    req.sampling |= api.sampling_fields(body, defaults, top_p="top_p")
    req.stream = api.get_bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    req.include_usage = api.get_bool(options, "include_usage")
    if req.stream and req.sampling["logprobs"]:
        raise RequestError("logprobs are not supported with stream", "logprobs")
    return req


def max_tokens(body: dict, limits: Limits, alias: str | None = None) -> int | None:
    name = alias if alias and body.get(alias) is not None else "max_tokens"
    return api.get_int(body, name, 1, limits.max_new_tokens)


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
        if isinstance(msg, dict):
            msg = {k: msg[k] for k in ("role", "content") if k in msg}
        flat.append(msg)
    return api.get_dialog({"messages": flat}, "messages", limits)


# --- answers ---------------------------------------------------------------------------

def usage(seqs: list[Sequence]) -> dict:
    prompt = sum(len(s.prompt_tokens) for s in seqs)
    completion = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(req: Request, meta: dict, chunk: bool = False) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}


def completion_logprobs(seq: Sequence, tokenizer) -> dict:
    prompt = seq.prompt_tokens if seq.params.echo else []
    tokens = prompt + seq.tokens
    values = (seq.prompt_logprobs if seq.params.echo else []) + seq.logprobs
    if prompt:
        values = [None] + values[1:]  # nothing predicts the first token
    pieces = [tokenizer.token_str(t) for t in tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(seq: Sequence, tokenizer) -> dict:
    content = []
    for token, value in zip(seq.tokens, seq.logprobs):
        content.append({"token": tokenizer.token_str(token), "logprob": value,
                        "bytes": list(tokenizer.token_bytes(token)), "top_logprobs": []})
    return {"content": content}


def answer(req: Request, seqs: list[Sequence], tokenizer, meta: dict) -> dict:
    choices = []
    for i, (seq, item) in enumerate(zip(seqs, req.inputs)):
        choice = {"index": i, "finish_reason": seq.finish_reason, "logprobs": None}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": seq.text}
            if seq.params.logprobs:
                choice["logprobs"] = chat_logprobs(seq, tokenizer)
        else:
            choice["text"] = (item if seq.params.echo else "") + seq.text
            if seq.params.logprobs:
                choice["logprobs"] = completion_logprobs(seq, tokenizer)
        choices.append(choice)
    return envelope(req, meta) | {"choices": choices, "usage": usage(seqs)}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chunk(req: Request, meta: dict, index: int, text: str, first: bool, finish_reason: str | None = None) -> str:
    if req.chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        choice = {"index": index, "delta": delta}
    else:
        if first and req.sampling.get("echo"):
            text = req.inputs[index] + text
        choice = {"index": index, "text": text}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    return sse(envelope(req, meta, chunk=True) | {"choices": [choice]})


STREAM_TYPE = "text/event-stream"


def last_chunks(req: Request, seqs: list[Sequence], meta: dict, tokenizer) -> str:
    """Each choice's finish_reason, the usage when asked for, and [DONE]."""
    out = "".join(chunk(req, meta, i, "", False, s.finish_reason) for i, s in enumerate(seqs))
    if req.include_usage:
        out += sse(envelope(req, meta, chunk=True) | {"choices": [], "usage": usage(seqs)})
    return out + "data: [DONE]\n\n"


def error(err: RequestError) -> dict:
    kind = "server_error" if err.status >= 500 else "NotFoundError" if err.status == 404 else "invalid_request_error"
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.status}}


def models(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "torchserve"}]}
