"""One rank of test_handler_tp.py, started by torchrun (tests/torchrun.py):

    handler_worker.py OUT_DIR OVERLAP CHECKPOINT

serves CHECKPOINT (the tests' DEMO) with handler.LlamaHandler as TorchServe's backend does
(ts.context.Context, each batch read by ts.service.Service.retrieve_data_for_inference).
Rank 0 gets the batches of REQUESTS, each arriving at its iteration; the other ranks get a
wrong copy of each (as TorchServe 0.12 may send: handler.py's docstring). Rank 0 saves its
answers, every rank the tokens of each request it finished and its scheduler's digest."""

import json
import os
import sys

import torch
import ts
from ts.context import Context
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from ts.service import Service

import handler

# (iteration it arrives at, id, url path, body)
REQUESTS = [
    (0, "stream", "", {"prompt": "Once upon a time", "max_new_tokens": 24, "temperature": 0, "stream": True}),
    (1, "two", "", {"prompt": ["The sea", "A cat"], "max_new_tokens": 12, "temperature": 0}),
    (2, "openai", "v1/completions", {"prompt": "My dog", "max_tokens": 10, "temperature": 0, "stream": True}),
    (3, "tokenize", "tokenize", {"prompt": "hello"}),
    (3, "refused", "", {"prompt": "x", "max_new_tokens": 0}),
]
DECODED = ["stream", "two", "openai"]  # the requests the engine decodes
PADDED = "two"  # its body ends in 5,000 spaces: more than one broadcast (collectives.MESSAGE_BYTES)
# what the other ranks' TorchServe copies hold instead
OTHER = [(0, "other", "", {"prompt": "Something else", "max_new_tokens": 30, "temperature": 0})]


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
            [{"name": "body", "value": (json.dumps(body) + " " * 5000 * (rid == PADDED)).encode(),
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


def lead(h, ctx: Context) -> dict:
    """Rank 0: every request of REQUESTS until each has its last message."""
    answers, known, finished = {}, set(), set()
    iteration = 0
    while len(finished) < len(REQUESTS):
        batch = [(rid, path, None if rid in known else body)
                 for at, rid, path, body in REQUESTS if at <= iteration and rid not in finished]
        for rid, (message, last) in serve(h, ctx, batch).items():
            answers.setdefault(rid, []).append(message)
            known.add(rid)  # TorchServe sends a body until the request's first message
            if last:
                finished.add(rid)
        iteration += 1
    return answers


def follow(h, ctx: Context, finished: dict):
    """The other ranks: an iteration for each of rank 0's, each on a wrong copy of its
    batch (another request, or the first one's alone), until the decoded requests are done."""
    wrong = [OTHER, REQUESTS[:1]]
    iteration = 0
    while set(finished) != set(DECODED):
        deliver(h, ctx, [(rid, path, body) for _, rid, path, body in wrong[iteration % 2]])
        iteration += 1


def main():
    out_dir, overlap, checkpoint = sys.argv[1], sys.argv[2] == "true", os.path.abspath(sys.argv[3])
    rank = int(os.environ["RANK"])
    h = handler.LlamaHandler()
    ctx = context(out_dir, overlap, checkpoint)
    h.initialize(ctx)
    finished = {}
    forget = h.forget

    def recording_forget(req_id):
        job = h.jobs.get(req_id)
        if job is not None:
            finished[req_id] = [s.tokens for s in job.seqs]
        forget(req_id)

    h.forget = recording_forget
    result = {}
    if rank == 0:
        result["answers"] = lead(h, ctx)
    else:
        follow(h, ctx, finished)
    result |= {"finished": finished, "digest": h.engine.scheduler.digest.hexdigest()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
