"""TorchServe handler: serves a tensor-parallel Llama with continuous batching.

TorchServe (continuousBatching: true) calls handle() again and again with every request in
flight: new ones with their body, known ones by id. Each call is one iteration: running
sequences get one token, waiting requests are admitted (prefill and first token), and each
request gets a message only when it has one: its answer, a streamed chunk, or an error.
Requests without a message this time are left out of the response, so TorchServe keeps
them and sends them again. torchrun starts one worker per rank; every rank receives the
same requests in the same order and does the same work, and only rank 0's answers go out.
"""

import json
import logging
import os
import time
from collections import deque

import torch
from ts.torch_handler.base_handler import BaseHandler

import api
from api import Defaults, Job, Limits, RequestError
from generate import Engine
from llama2 import tp_llama

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LlamaHandler(BaseHandler):
    def initialize(self, ctx):
        config = ctx.model_yaml_config
        if not config.get("continuousBatching"):
            raise ValueError("model-config.yaml must set continuousBatching: true (this handler batches "
                             "requests step by step)")
        settings = dict(config.get("handler") or {})
        model_dir = ctx.system_properties["model_dir"]
        checkpoint = os.path.join(model_dir, settings.pop("checkpoint", "checkpoint"))
        tokenizer = os.path.join(model_dir, settings.pop("tokenizer", os.path.join(checkpoint, "tokenizer.model")))
        max_seq_len = int(settings.pop("max_seq_len", 2048))
        dtype = settings.pop("dtype", "auto")
        self.limits = api.dataclass_from(Limits, settings.pop("limits", None), "handler.limits")
        self.defaults = api.dataclass_from(Defaults, settings.pop("defaults", None), "handler.defaults")
        if settings:
            raise ValueError(f"unknown keys in the handler section of model-config.yaml: {sorted(settings)}")
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"handler.dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")

        slots = int(ctx.system_properties.get("batch_size") or 1)  # batchSize: one KV-cache row each
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        start = time.perf_counter()
        self.llama = tp_llama(None, checkpoint, tokenizer, world_size, dtype=DTYPES.get(dtype),
                              max_batch_size=slots, max_seq_len=max_seq_len)
        logger.info("loaded %s on %d rank(s) in %.1f s: %s", checkpoint, world_size,
                    time.perf_counter() - start, self.llama.model.params)
        self.tokenizer = self.llama.tokenizer
        self.engine = Engine(self.llama.model, self.tokenizer)
        self.max_seq_len = max_seq_len
        self.limits.max_prompts = min(self.limits.max_prompts, slots)
        self.jobs: dict[str, Job] = {}  # by TorchServe request id
        self.waiting: deque[str] = deque()  # admitted first come, first served
        self.initialized = True

    # --- one iteration: preprocess -> inference -> postprocess (BaseHandler.handle) -------

    def preprocess(self, data):
        """Forget requests TorchServe no longer sends (their client went away) and read the
        new ones. Returns the errors to answer now, by batch index."""
        ids = self.context.request_ids
        for req_id in set(self.jobs) - set(ids.values()):
            self.forget(req_id)
        errors = {}
        for idx, req_id in ids.items():
            if req_id in self.jobs:
                continue
            try:
                self.jobs[req_id] = self.new_job(idx, data[idx])
                self.waiting.append(req_id)
            except RequestError as e:
                errors[idx] = e
            except Exception as e:  # a bug must cost one request, never the worker
                logger.exception("cannot read request %s", req_id)
                errors[idx] = RequestError(f"internal error: {e}", None, status=500)
        return errors

    def inference(self, errors):
        """Give every running sequence one token, then admit waiting requests in order
        while KV-cache slots are free."""
        try:
            self.engine.step()
        except Exception as e:
            logger.exception("decode step failed")
            for job in self.jobs.values():
                if any(not s.done for s in job.seqs):
                    job.error = RequestError(f"internal error: {e}", None, status=500)
        while self.waiting:
            job = self.jobs[self.waiting[0]]
            if len(job.prompts) > len(self.engine.free_slots):
                break
            self.waiting.popleft()
            try:
                job.seqs = [self.engine.add(tokens, params) for tokens, params in job.prompts]
            except Exception as e:
                logger.exception("prefill failed")
                job.error = RequestError(f"internal error: {e}", None, status=500)
        return errors

    def postprocess(self, errors):
        """The message of each request that has one; the others are left out (TorchServe
        keeps them for the next iteration)."""
        ids = self.context.request_ids
        out = [""] * len(ids)
        stream_next = [None] * len(out)
        for idx, req_id in list(ids.items()):
            if idx in errors:
                http, message = self.is_http(idx), error_message(errors[idx])
            else:
                job = self.jobs[req_id]
                http, message = job.http, self.message(job)
            if message is None:
                del ids[idx]
                continue
            out[idx], status, content_type, kind = message
            self.context.set_response_status(status, "", idx)
            self.context.set_response_content_type(idx, content_type)
            # TorchServe turns these flags into the ts_stream_next header: False for a chunk
            # with more to come, True for the last one. A one-message HTTP answer carries no
            # header; gRPC's stream call needs it on every message.
            stream_next[idx] = {"chunk": False, "last": True, "once": None if http else True}[kind]
            if kind != "chunk":
                self.forget(req_id)
        self.context.stopping_criteria = [lambda _, flag=flag: flag for flag in stream_next]
        return out

    # --- requests ---------------------------------------------------------------------

    def new_job(self, idx: int, data: dict) -> Job:
        if data.get("body") is None and data.get("data") is None:
            raise RequestError("no JSON body found: send one with Content-Type: application/json "
                               "(curl: -H 'Content-Type: application/json')", "body", status=415)
        raw = data.get("body") if data.get("body") is not None else data.get("data")
        request = api.parse_native(api.read_body(raw, self.limits), self.limits, self.defaults)
        prompts = api.sequences(request, self.tokenizer, self.max_seq_len, self.limits, self.defaults)
        return Job(request, self.is_http(idx), prompts)

    def is_http(self, idx: int) -> bool:
        return any(k.lower() in ("url_path", "host") for k in self.context.get_all_request_header(idx))

    def forget(self, req_id: str):
        """Free what a finished or abandoned request holds."""
        job = self.jobs.pop(req_id, None)
        if job is None:
            return
        for seq in job.seqs:
            self.engine.release(seq)
        if req_id in self.waiting:
            self.waiting.remove(req_id)

    def message(self, job: Job):
        """(body, status, content type, kind) for this iteration, or None; kind is "once"
        (the whole answer), "chunk" (more to come) or "last"."""
        if job.error is not None:
            if job.started:
                return json.dumps(api.error_body(job.error)) + "\n", 200, JSONL, "last"
            return error_message(job.error)
        if not job.seqs:
            return None  # waiting for KV-cache slots
        req, done = job.request, all(s.done for s in job.seqs)
        if not req.stream:
            if not done:
                return None
            return json.dumps(api.native_answer(req, job.seqs, self.tokenizer)), 200, JSON, "once"
        if not job.http and not done:
            # TorchServe 0.12 drops a gRPC stream after its first message (GRPCJob.isOpen()
            # returns isCancelled()), so a gRPC stream goes out whole, in one message.
            return None
        lines = [api.native_chunk(req, i, text, first=not job.started)
                 for i, s in enumerate(job.seqs) if (text := s.new_text()) or not job.started]
        # An HTTP stream's first message opens it, so its last chunks wait for a later one.
        last = done and (job.started or not job.http)
        if last:
            lines += [api.native_final_chunk(req, i, s, self.tokenizer) for i, s in enumerate(job.seqs)]
        if not lines:
            return None
        job.started = True
        return "".join(json.dumps(line) + "\n" for line in lines), 200, JSONL, "last" if last else "chunk"


JSON, JSONL = "application/json", "application/jsonl"


def error_message(err: RequestError):
    return json.dumps(api.error_body(err)), err.status, JSON, "once"
