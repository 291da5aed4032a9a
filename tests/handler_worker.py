"""One rank of test_handler_tp.py, started by tests/torchrun.py:

    handler_worker.py OUT_DIR OVERLAP CHECKPOINT [SUITE]

serves CHECKPOINT with handler.LlamaHandler as TorchServe's backend does (ts.context.Context,
each batch read by ts.service.Service.retrieve_data_for_inference). Rank 0 gets the batches
of SUITE's requests, each arriving at its iteration; the other ranks get a wrong copy of
each (as TorchServe 0.12 may send: handler.py's docstring). Rank 0 saves its answers, every
rank the prompt and tokens of each request it finished and its scheduler's digest.
SUITE "demo" (the default) is for the tests' DEMO; "dated" is chat for a Llama 3 checkpoint
whose template prints the date, with the other ranks' clocks a day ahead of rank 0's."""

import json
import os
import sys
from datetime import datetime, timedelta

import torch
import ts
from ts.context import Context
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from ts.service import Service

import chat_format
import chat_template
import handler

# (iteration it arrives at, id, url path, body)
REQUESTS = [
    (0, "stream", "", {"prompt": "Once upon a time", "max_new_tokens": 24, "temperature": 0, "stream": True}),
    # its settings make rank 0's batch longer than one broadcast (collectives.MESSAGE_BYTES);
    # a bias of 0 changes no logit
    (1, "two", "", {"prompt": ["The sea", "A cat"], "max_new_tokens": 12, "temperature": 0,
                    "logit_bias": {str(i): 0 for i in range(600)}}),
    (2, "openai", "v1/completions", {"prompt": "My dog", "max_tokens": 10, "temperature": 0, "stream": True}),
    (3, "tokenize", "tokenize", {"prompt": "hello"}),
    (3, "refused", "", {"prompt": "x", "max_new_tokens": 0}),
]
DECODED = ["stream", "two", "openai"]  # the requests the engine decodes
# what the other ranks' TorchServe copies hold instead
OTHER = [(0, "other", "", {"prompt": "Something else", "max_new_tokens": 30, "temperature": 0})]
DIALOG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the date?"}]
SUITES = {
    "demo": (REQUESTS, DECODED, OTHER),
    "dated": ([(0, "chat", "", {"dialog": DIALOG, "max_new_tokens": 6, "temperature": 0}),
               (1, "openai-chat", "v1/chat/completions", {"messages": DIALOG, "max_tokens": 6, "temperature": 0})],
              ["chat", "openai-chat"],
              [(0, "other", "", {"dialog": DIALOG[1:], "max_new_tokens": 9, "temperature": 0})]),
}


class Tomorrow(datetime):
    """A clock a day ahead: what a rank sees across midnight while rank 0 does not yet."""
    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) + timedelta(days=1)


def context(out_dir: str, overlap: bool, checkpoint: str) -> Context:
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    settings = {"checkpoint": checkpoint, "max_seq_len": 512, "overlap": overlap}
    if overlap:
        settings["steps_per_iteration"] = 1
    return Context("llama", out_dir, None, 4, None, ts.__version__, metrics=metrics,
                   model_yaml_config={"continuousBatching": True, "handler": settings})


def deliver(h, ctx: Context, batch: list) -> tuple[dict, list]:
    """What TorchServe's backend does with batch [(id, url path, body or None: known to the
    handler)]: the handler's handle(); returns the batch's ids (by index) and its output."""
    raw = [{"requestId": rid.encode(), "headers": [{"name": b"url_path", "value": path.encode()},
                                                   {"name": b"host", "value": b"localhost"}],
            "parameters": [] if body is None else
            [{"name": "body", "value": json.dumps(body).encode(),
              "contentType": "application/json"}]}
           for rid, path, body in batch]
    headers, data, ids = Service.retrieve_data_for_inference(raw)
    ctx.request_ids, ctx.request_processor, ctx.metrics.request_ids = ids, headers, ids
    sent = dict(ids)
    return sent, h.handle(data, ctx)


def serve(h, ctx: Context, batch: list) -> dict:
    """Rank 0's iteration of batch: {id: (message, last)} for the requests that got one (the
    handler leaves the others out of request_ids)."""
    sent, out = deliver(h, ctx, batch)
    return {sent[idx]: (out[idx], ctx.stopping_criteria[idx](None) is not False) for idx in ctx.request_ids}


def lead(h, ctx: Context, requests: list) -> dict:
    """Rank 0: every request of requests until each has its last message."""
    answers, known, finished = {}, set(), set()
    iteration = 0
    while len(finished) < len(requests):
        batch = [(rid, path, None if rid in known else body)
                 for at, rid, path, body in requests if at <= iteration and rid not in finished]
        for rid, (message, last) in serve(h, ctx, batch).items():
            answers.setdefault(rid, []).append(message)
            known.add(rid)  # TorchServe sends a body until the request's first message
            if last:
                finished.add(rid)
        iteration += 1
    return answers


def follow(h, ctx: Context, finished: dict, requests: list, decoded: list, other: list):
    """The other ranks: an iteration for each of rank 0's, each on a wrong copy of its
    batch (another request, or the first one's alone), until the decoded requests are done."""
    wrong = [other, requests[:1]]
    iteration = 0
    while set(finished) != set(decoded):
        deliver(h, ctx, [(rid, path, body) for _, rid, path, body in wrong[iteration % 2]])
        iteration += 1


def main():
    out_dir, overlap, checkpoint = sys.argv[1], sys.argv[2] == "true", os.path.abspath(sys.argv[3])
    requests, decoded, other = SUITES[sys.argv[4] if len(sys.argv) > 4 else "demo"]
    rank = int(os.environ["RANK"])
    if rank != 0:
        chat_template.datetime = Tomorrow
    h = handler.LlamaHandler()
    ctx = context(out_dir, overlap, checkpoint)
    h.initialize(ctx)
    finished = {}
    forget = h.requests.forget

    def recording_forget(req_id):
        job = h.requests.jobs.get(req_id)
        if job is not None:
            finished[req_id] = [(s.prompt_tokens, s.tokens) for s in job.seqs]
        forget(req_id)

    h.requests.forget = recording_forget
    result = {"own_render": chat_format.encode_dialog(h.engine.tokenizer, DIALOG)}  # what this rank's clock renders
    if rank == 0:
        result["answers"] = lead(h, ctx, requests)
    else:
        follow(h, ctx, finished, requests, decoded, other)
    result |= {"finished": finished, "digest": h.engine.scheduler.digest.hexdigest()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
