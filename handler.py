"""TorchServe handler: serves a tensor-parallel Llama with continuous batching.

TorchServe (continuousBatching: true) calls handle() again and again with every request in
flight: new ones with their body, known ones by id. Each call is one iteration: new
requests' prompts are queued in the engine, the engine steps (a token for every running
sequence, prompts or chunks of them for the ones it admits), and each request gets a
message only when it has one: its answer, a streamed chunk, or an error. With
handler.overlap, the steps run on the engine's thread between iterations, while TorchServe
carries the messages out and brings the next batch. Requests without a message this time
are left out of the response, so TorchServe keeps them and sends them again.

torchrun starts one worker per rank, and rank 0 leads each iteration: it reads TorchServe's
batch and every rank runs rank 0's copy (ranks.py says why); loading.py builds the engine.
"""

import logging
import os
import time

from ts.torch_handler.base_handler import BaseHandler

import collectives
import loading
import metrics
import ranks
from api import Message
from engine import Engine
from serving import InFlight
from serving_config import ServingConfig

logger = logging.getLogger(__name__)
GRAMMAR_WAIT = 0.05  # s: how long an iteration with only grammars to wait for waits for them

class LlamaHandler(BaseHandler):
    leader = None  # with more than one rank: the group rank 0 sends its batches on
    in_flight = InFlight  # what keeps the requests in flight (the tests' handler gives another)

    def initialize(self, ctx):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.progress = loading.Progress(self.rank, self.world_size)
        try:
            self.load(ctx)
        except Exception as e:
            self.progress("failed", error=f"{type(e).__name__}: {e}")
            raise
        self.progress("ready")
        self.initialized = True

    def load(self, ctx):
        config = ServingConfig.from_model_config(ctx.model_yaml_config)  # what make serve checked
        self.max_seq_len = config.max_seq_len
        batch_size = int(ctx.system_properties.get("batch_size") or 1)  # batchSize: sequences decoded together
        engine, run = loading.load(config, ctx.system_properties["model_dir"], batch_size, self.world_size,
                                   self.progress)
        config.limits.max_prompts = min(config.limits.max_prompts, batch_size)
        self.use_engine(engine, self.in_flight(engine, config.limits, config.defaults, ctx.model_name),
                        run.steps_per_iteration, run.overlap)
        self.rank0 = self.rank == 0
        # Bodies reach the handler as bytes, not as JSON TorchServe decoded leniently (NaN,
        # scalars): read_body checks every one against limits.max_body_bytes and parses it strictly.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        if self.world_size > 1:
            self.leader = collectives.leader_group()

    def use_engine(self, engine: Engine, requests: InFlight, steps_per_iteration: tuple[int, int, float] = (1, 1, 0.0),
                   overlap: bool = True):
        """Serve with engine the requests of requests (none in flight yet). steps_per_iteration:
        (at least, at most, the seconds that decide in between: Engine.run)."""
        self.engine, self.requests = engine, requests
        self.steps_per_iteration, self.overlap = steps_per_iteration, overlap
        self.steps, self.engine_ms = 0, 0.0  # of the last steps waited for
        self.idle = True  # the engine had nothing to do when this iteration's requests came

    # --- one iteration: preprocess -> inference -> postprocess (BaseHandler.handle) -------
    # With overlap, the engine's steps run on its own thread, started at the end of an
    # iteration: they overlap TorchServe's round trip (the messages going out, the next
    # batch coming in), and the next iteration waits for them before it reads the batch.
    # Without, each iteration runs its steps before it answers, on TorchServe's thread (the
    # one that loaded the model: on a CPU, a second thread's OpenMP team measured slower).

    def preprocess(self, data):
        """Rank 0's reading of TorchServe's batch (read_batch), on every rank (the others'
        own copies go unread), admitted (admit)."""
        immediate = {}
        batch = self.read_batch(data, immediate) if self.rank0 else None
        if self.leader is not None:
            batch = ranks.broadcast_batch(batch, self.leader)
        return self.admit(batch, immediate)

    def read_batch(self, data, immediate: dict) -> list[dict]:
        """TorchServe's batch as every rank runs it, in batch order: each request's id and
        protocol, and for a request new to the handler, what InFlight.read made of it
        ("job"), "at_once" when rank 0 answered it already (its message, the answer or an
        error, goes into immediate by batch index, on rank 0 alone), or "compiling" while
        its grammars compile."""
        if self.requests.compiling and self.engine.pending is None and not self.engine.running:
            self.requests.wait_for_grammars(GRAMMAR_WAIT)  # nothing else to do: TorchServe would spin
        batch = []
        for idx, req_id in sorted(self.context.request_ids.items()):
            item = {"id": req_id, "http": self.is_http(idx)}
            if req_id not in self.requests.jobs:
                path = self.context.get_request_header(idx, "url_path") or ""
                body = data[idx].get("body") if data[idx].get("body") is not None else data[idx].get("data")
                read = self.requests.read(req_id, path, body)
                if isinstance(read, Message):
                    immediate[idx], item["at_once"] = read, True
                else:
                    item["job" if read is not None else "compiling"] = read
            batch.append(item)
        self.requests.drop_compiles({item["id"] for item in batch})
        return batch

    def admit(self, batch: list[dict], immediate: dict):
        """Wait for the steps the last iteration started, forget the requests no longer in
        the batch (their client went away) and queue the new ones' sequences. Returns the
        messages to send now (rank 0's immediate; None on the other ranks), by batch index."""
        self.wait_for_steps()
        self.batch = batch
        for req_id in set(self.requests.jobs) - {item["id"] for item in batch}:
            self.requests.forget(req_id)
        self.idle = not self.engine.running
        for item in batch:
            if "job" in item:
                self.requests.admit(item["id"], item["job"], item["http"])
        return {idx: immediate.get(idx) for idx, item in enumerate(batch) if "at_once" in item}

    def inference(self, immediate):
        """Each request's message, by batch index (None: nothing to send yet), after this
        iteration's steps (without overlap), or after those the last one started (with
        overlap; then the next ones start). An engine that was idle steps first either way,
        so that a first token goes out in this iteration rather than the next."""
        if self.idle or not self.overlap:  # start_steps starts nothing without work
            self.start_steps()
            self.wait_for_steps()
        messages = {}
        for idx, item in enumerate(self.batch):
            if idx in immediate or "compiling" in item:
                messages[idx] = item["http"], immediate.get(idx)
                continue
            job = self.requests.jobs[item["id"]]
            message = self.requests.guarded_message(job, item["id"])
            messages[idx] = job.http, message
            if message is not None and message.kind != "chunk":  # the request's last message
                if self.rank0:
                    metrics.record_request(self.context.metrics, job)
                self.requests.forget(item["id"])
        if self.rank0:
            metrics.record_engine(self.context.metrics, self.engine, self.steps, self.engine_ms)
        if self.overlap:
            self.start_steps()
        return messages

    def postprocess(self, messages):
        """The message of each request that has one; the others are left out (TorchServe
        keeps them for the next iteration)."""
        ids = self.context.request_ids
        if not self.rank0:
            return [""] * len(ids)  # never sent: TorchServe takes rank 0's answers only
        out = [""] * len(ids)
        stream_next = [None] * len(ids)
        for idx, (http, message) in messages.items():
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
        self.context.stopping_criteria = [lambda _, flag=flag: flag for flag in stream_next]
        return out

    def start_steps(self):
        """Up to steps_per_iteration engine steps (each one a token for every running
        sequence, and prompts or chunks of them for the sequences admitted) on the engine's
        thread, when there is work."""
        if not self.engine.running:
            return
        self.engine.start(self.run_steps)

    def run_steps(self) -> tuple[int, float]:
        """The steps (on the engine's thread with overlap), and how long they took (ms)."""
        begin = time.perf_counter()
        least, most, seconds = self.steps_per_iteration
        steps = self.engine.run(most, seconds, least)
        return steps, (time.perf_counter() - begin) * 1000

    def wait_for_steps(self):
        """Wait for the steps start_steps began, if any. If they failed, the requests with
        a sequence in the failed step fail; those still waiting go on."""
        try:
            result = self.engine.wait()
        except Exception as e:
            failed = self.requests.in_step()
            logger.exception("engine step failed; requests in it: %s", ", ".join(failed))
            ranks.exit_if_broken(e, self.engine.device)
            self.requests.fail(failed)
            return
        if result is None:
            return
        self.steps, self.engine_ms = result
        self.requests.note_first_tokens(time.perf_counter())

    def is_http(self, idx: int) -> bool:
        return any(k.lower() in ("url_path", "host") for k in self.context.get_all_request_header(idx))

