"""The native JSON API: its request body (parse) and its answers, which implement
api.Format as openai_api's do."""

import json

import generate
from api import (Defaults, Limits, Request, RequestError, get_bool, get_dialog, get_int, get_n,
                 get_prompts, get_top_logprobs, sampling_fields, type_name)
from constraint_fields import get_constraint
from sequence import Sequence

NATIVE_FIELDS = {"prompt", "dialog", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                 "stop", "logprobs", "top_logprobs", "echo", "stream", "n", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "structured_outputs",
                 "speculative"}


def parse(body, limits: Limits, defaults: Defaults) -> Request:
    """Its constraint is compiled later (constraint_fields.compile_constraints)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type_name(body)}", "body")
    unknown = sorted(set(body) - NATIVE_FIELDS)
    if unknown:
        raise RequestError(f"unknown fields {unknown}; accepted: {sorted(NATIVE_FIELDS)}", unknown[0])
    given = [k for k in ("prompt", "dialog", "messages") if k in body]
    if len(given) != 1:
        raise RequestError("give exactly one of prompt (text completion) or dialog/messages (chat)"
                           + (f", not {' and '.join(given)}" if given else ""), "prompt")
    req = Request("native", chat=given[0] != "prompt", input_field=given[0])
    if req.chat:
        req.inputs = [get_dialog(body, given[0], limits)]
    else:
        req.inputs, req.batched = get_prompts(body, "prompt", limits)
    req.stream = get_bool(body, "stream")
    req.max_new_tokens = get_int(body, "max_new_tokens", 1, limits.max_new_tokens)
    req.n = get_n(body, len(req.inputs), limits)
    req.batched = req.batched or req.n > 1
    req.sampling = sampling_fields(body, defaults, top_p="top_p")
    req.sampling["logprobs"] = get_bool(body, "logprobs")
    req.sampling["top_logprobs"] = get_top_logprobs(body, req.sampling["logprobs"], "logprobs: true")
    req.sampling["echo"] = get_bool(body, "echo")
    if req.chat and req.sampling["echo"]:
        raise RequestError("echo is only for text completion", "echo")
    req.sampling["constraint"] = get_constraint(body, ("structured_outputs",), req.to_compile)
    return req


STREAM_TYPE = "application/jsonl"  # one JSON object per line
CHOICE_ERRORS = True  # a choice whose grammar broke ends with finish_reason "error"


def answer(req: Request, seqs: list[Sequence], tokenizer, meta: dict) -> dict | list:
    answers = []
    for k, seq in enumerate(seqs):
        if req.chat:
            generation = {"role": "assistant", "content": seq.text}
        else:
            generation = (req.texts[k // req.n] if seq.params.echo else "") + seq.text
        answers.append(generate.prediction(seq, tokenizer, generation))
    return answers if req.batched else answers[0]


def chunk(req: Request, meta: dict, index: int, text: str, first: bool) -> str:
    """One streamed line with new text (the first one starts with the prompt when echo)."""
    if first and req.sampling.get("echo"):
        text = req.texts[index // req.n] + text
    return json.dumps(({"index": index} if req.batched else {}) | {"text": text}) + "\n"


def last_chunks(req: Request, seqs: list[Sequence], meta: dict, tokenizer) -> str:
    """Each sequence's last line: finish_reason and usage (and tokens and logprobs when
    asked for)."""
    lines = []
    for i, seq in enumerate(seqs):
        done = generate.prediction(seq, tokenizer, None)
        del done["generation"]
        lines.append(json.dumps(({"index": i} if req.batched else {}) | {"text": ""} | done) + "\n")
    return "".join(lines)


def error(err: RequestError) -> dict:
    return {"code": err.status, "type": "invalid_request_error" if err.status < 500 else "server_error",
            "param": err.param, "message": err.message}


def error_tail(err: RequestError, req: Request, meta: dict) -> str:
    """The end of a stream that fails after it began: a line with the error."""
    return json.dumps(error(err)) + "\n"
