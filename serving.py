"""The requests in flight on one rank, apart from TorchServe: rank 0 reads each new request
into what every rank needs to run it (read: parse, render, tokenize, then compile its
grammars on a thread of their own), every rank queues its sequences (admit), and each
iteration gives a request its message when it has one (message); forget frees what a
request holds. handler.py is the TorchServe side."""

import hashlib
import json
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import api
import constraint_fields
import messages_api
import native_api
import openai_api
import responses_api
from api import Format, Job, Message, RequestError

logger = logging.getLogger(__name__)

# url_path (what follows /predictions/<model>/<version>/) -> API
ROUTES = {"": "native", "v1/completions": "completions", "v1/chat/completions": "chat", "v1/models": "models",
          "v1/responses": "responses", "v1/messages": "messages", "v1/messages/count_tokens": "count_tokens",
          "tokenizer_info": "tokenizer_info", "tokenize": "tokenize", "detokenize": "detokenize"}
AT_ONCE = {"models", "tokenizer_info", "tokenize", "detokenize", "count_tokens"}  # answered without decoding
FORMATS = {"native": native_api, "responses": responses_api, "messages": messages_api}  # by Request.api; else OpenAI's
ID_PREFIXES = {"native": "cmpl-", "completions": "cmpl-", "chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}
JSON = "application/json"
# A request's grammars compile on the compiler's thread while the engine steps; a read waits
# this long for them, so that a grammar in the cache (or a quick one) joins this iteration.
COMPILE_WAIT = 0.005


class InFlight:
    def __init__(self, engine, limits: api.Limits, defaults: api.Defaults, model_name: str):
        self.engine, self.tokenizer, self.max_seq_len = engine, engine.tokenizer, engine.max_seq_len
        self.limits, self.defaults, self.model_name = limits, defaults, model_name
        self.created = int(time.time())
        self.rank0 = os.environ.get("RANK", "0") == "0"
        self.jobs: dict[str, Job] = {}  # by TorchServe request id
        # rank 0's requests whose grammars compile: (what new_job made of them, the compile)
        self.compiling: dict[str, tuple[tuple, Future]] = {}
        self.compiler: ThreadPoolExecutor | None = None  # started at the first grammar

    def read(self, req_id: str, path: str, raw) -> tuple | Message | None:
        """What every rank's Job needs of a new request (new_job), the message that answers
        it at once, or None while its grammars compile (TorchServe sends it again next
        iteration; read it then). One bad request costs itself alone: whatever it raises (a
        tokenizer's Rust panic is a BaseException) becomes its own error."""
        fmt = format_of(path)
        try:
            return self.compiled(req_id) if req_id in self.compiling else self.start(req_id, path, raw)
        except RequestError as e:
            return error_message(fmt, e)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # a bug must cost one request, never the worker
            logger.exception("cannot read request %s", req_id)
            return error_message(fmt, internal_error(req_id))

    def start(self, req_id: str, path: str, raw) -> tuple | Message | None:
        """A new request's answer at once, or its job spec after every cheap check; its
        grammars, the costly check, then compile on the compiler's thread (compiled)."""
        route = ROUTES.get(path)
        if route is None and path.startswith("v1/responses/"):  # retrieve, cancel, delete
            raise RequestError(f"no response /{path}: {responses_api.UNSTORED}", "url", status=404)
        if route is None:
            raise RequestError(f"no route /{path}; the routes are /, /v1/completions, /v1/chat/completions, "
                               "/v1/responses, /v1/messages, /v1/messages/count_tokens, /v1/models, "
                               "/tokenizer_info, /tokenize and /detokenize", "url", status=404)
        if route in AT_ONCE:
            return Message(json.dumps(self.answer_at_once(route, raw)), 200, JSON, "once")
        spec = self.new_job(req_id, route, raw)
        if not spec[0].to_compile:
            return spec
        self.compiler = self.compiler or ThreadPoolExecutor(1, thread_name_prefix="grammars")
        compiling = self.compiler.submit(constraint_fields.compile_constraints, spec[0], self.engine.matcher)
        self.compiling[req_id] = spec, compiling
        wait([compiling], COMPILE_WAIT)
        return self.compiled(req_id)

    def compiled(self, req_id: str) -> tuple | None:
        """A compiling request's job spec once its grammars compiled (the RequestError of one
        that does not), or None while they compile."""
        spec, compiling = self.compiling[req_id]
        if not compiling.done():
            return None
        del self.compiling[req_id]
        compiling.result()
        return spec

    def wait_for_grammars(self, timeout: float):
        """Wait until a compiling request's grammars are done, or timeout seconds."""
        wait([compiling for _, compiling in self.compiling.values()], timeout, FIRST_COMPLETED)

    def drop_compiles(self, req_ids: set[str]):
        """Forget the compiling requests not in req_ids (their clients went away)."""
        for req_id in set(self.compiling) - req_ids:
            self.compiling.pop(req_id)[1].cancel()  # one already compiling finishes into the cache

    def answer_at_once(self, route: str, raw) -> dict:
        if route == "models":
            return openai_api.models(self.model_name, self.created)
        if route == "tokenizer_info":
            return openai_api.tokenizer_info(self.tokenizer, self.max_seq_len)
        body = api.read_body(request_body(raw), self.limits)
        if route == "tokenize":
            return openai_api.tokenize(body, self.tokenizer, self.max_seq_len, self.limits)
        if route == "count_tokens":
            return messages_api.count_tokens(body, self.tokenizer, self.model_name, self.limits)
        return openai_api.detokenize(body, self.tokenizer)

    def new_job(self, req_id: str, route: str, raw) -> tuple:
        """(request, [(prompt tokens, sampling params)], meta): what every rank's Job needs,
        once the request's grammars compile (read sees to it: the costly check, last)."""
        body = api.read_body(request_body(raw), self.limits)
        if route == "native":
            request = native_api.parse(body, self.limits, self.defaults)
        elif route in ("responses", "messages"):
            request = FORMATS[route].parse(body, self.model_name, self.limits, self.defaults)
        else:
            request = openai_api.parse(route, body, self.model_name, self.limits, self.defaults)
        prompts = api.sequences(request, self.tokenizer, self.max_seq_len, self.limits, self.defaults)
        for tokens, params in prompts:  # all checks before any sequence is queued
            try:
                self.engine.check(tokens, params)
            except ValueError as e:
                raise RequestError(str(e), "prompt") from None
        meta = {"id": ID_PREFIXES[request.api] + req_id, "created": int(time.time()),
                "model": self.model_name, "prompt_tokens": len(prompts[0][0])}
        return request, prompts, meta

    def admit(self, req_id: str, spec: tuple, http: bool):
        """Queue the sequences of a request that read gave spec for."""
        request, prompts, meta = spec
        job = Job(req_id, request, http, prompts, meta)
        job.seqs = [self.engine.add(tokens, params) for tokens, params in prompts]
        self.jobs[req_id] = job

    def in_step(self) -> list[str]:
        """The requests with a sequence in the engine's step: every running one."""
        running = set(self.engine.scheduler.running)
        return [req_id for req_id, job in self.jobs.items() if running.intersection(job.seqs)]

    def fail(self, req_ids: list[str]):
        """After a failed step: these requests (in_step's) fail, and free their blocks."""
        for req_id in req_ids:
            job = self.jobs[req_id]
            job.error = internal_error(req_id)
            for seq in job.seqs:
                self.engine.release(seq)

    def note_first_tokens(self, now: float):
        for job in self.jobs.values():
            if job.first_token is None and any(s.tokens or s.done for s in job.seqs):
                job.first_token = now

    def forget(self, req_id: str):
        """Free what a finished or abandoned request holds."""
        job = self.jobs.pop(req_id, None)
        if job is None:
            return
        for seq in job.seqs:
            self.engine.release(seq)
        for i, seq in enumerate(job.seqs):
            if seq.finish_reason == "error" and self.rank0:  # rank 0's matchers compute masks: it knows why
                logger.error("request %s: sequence %d's grammar broke after %d tokens: %s", req_id, i,
                             len(seq.tokens), grammar_error(seq))
        # every rank logs this line: the tests compare the ranks' sequence ids, tokens and
        # scheduling decisions (block tables included) so far
        tokens = [s.tokens for s in job.seqs]
        logger.info("done %s rank=%s seqs=%s tokens=%s decisions=%s generated=%s preemptions=%d", req_id,
                    os.environ.get("RANK", "0"), [s.id for s in job.seqs],
                    hashlib.sha1(repr(tokens).encode()).hexdigest(), self.engine.scheduler.digest.hexdigest(),
                    [len(t) for t in tokens], self.engine.scheduler.preemptions)

    def guarded_message(self, job: Job, req_id: str) -> Message | None:
        """message(job), or its error when formatting it raises: one bad answer costs its
        own request alone, never the iteration's other requests or the worker."""
        try:
            return self.message(job)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            logger.exception("cannot answer request %s", req_id)
            job.error = internal_error(req_id)
            return self.message(job)

    def message(self, job: Job) -> Message | None:
        """The request's message for this iteration, or None."""
        req = job.request
        fmt: Format = FORMATS.get(req.api, openai_api)
        if job.error is not None:
            if not job.started:
                return error_message(fmt, job.error)
            return Message(fmt.error_tail(job.error, req, job.meta), 200, fmt.STREAM_TYPE, "last")
        if not any(s.tokens or s.done for s in job.seqs):
            return None  # its prompts are waiting or being prefilled
        done = all(s.done for s in job.seqs)
        if done and not fmt.CHOICE_ERRORS and any(s.finish_reason == "error" for s in job.seqs):
            job.error = broken_grammar(job)
            return self.message(job)
        if not req.stream:
            if not done:
                return None
            return Message(json.dumps(fmt.answer(req, job.seqs, self.tokenizer, job.meta)), 200, JSON, "once")
        if not job.http and not done:
            # TorchServe 0.12 drops a gRPC stream after its first message (GRPCJob.isOpen()
            # returns isCancelled()), so a gRPC stream goes out whole, in one message.
            return None
        pieces = [fmt.chunk(req, job.meta, i, text, first=not job.started)
                  for i, s in enumerate(job.seqs) if (text := s.new_text()) or not job.started]
        # An HTTP stream's first message opens it, so its last chunks wait for a later one.
        last = done and (job.started or not job.http)
        if last:
            pieces.append(fmt.last_chunks(req, job.seqs, job.meta, self.tokenizer))
        if not pieces:
            return None
        job.started = True
        return Message("".join(pieces), 200, fmt.STREAM_TYPE, "last" if last else "chunk")


def format_of(path: str) -> Format:
    """The API whose shapes the answer and errors to a request on path take."""
    if path.startswith("v1/messages"):
        return messages_api
    route = ROUTES.get(path)
    if route in FORMATS:
        return FORMATS[route]
    return openai_api if path.startswith("v1") or route in AT_ONCE else native_api


def request_body(raw):
    if raw is None:
        raise RequestError("no JSON body found: send one with Content-Type: application/json "
                           "(curl: -H 'Content-Type: application/json')", "body", status=415)
    return raw


def internal_error(req_id: str) -> RequestError:
    """A 500 for what went wrong inside the server: the request id that its log lines name,
    and nothing of the exception, which is the server's business."""
    return RequestError(f"internal error; the server's log has the details under request id {req_id}", None,
                        status=500)


def grammar_error(seq) -> str:
    """Why seq's grammar broke, as llguidance says it (first line; rank 0's matcher: the other
    ranks hold none, and their messages are never sent)."""
    lines = seq.matcher.error().replace("<non-verbose/>", "").strip().splitlines() if seq.matcher else []
    return lines[0] if lines else "a token it refuses"


def broken_grammar(job: Job) -> RequestError:
    """The error of a request whose sequence's grammar broke, in an API whose answers cannot say so."""
    seq = next(s for s in job.seqs if s.finish_reason == "error")
    return RequestError(f"the answer broke off after {len(seq.tokens)} tokens: its constraint failed "
                        f"({grammar_error(seq)}); the server's log has it under request id {job.req_id}", None,
                        status=500)


def error_message(fmt: Format, err: RequestError) -> Message:
    return Message(json.dumps(fmt.error(err)), err.status, JSON, "once")
