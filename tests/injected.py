"""The faults tests/fault_handler.py injects: a request whose prompt holds FAULT.format(where)
raises there, so that a test can show what a bug costs: while it is read ("preprocess"),
while its answer is formatted ("answer"), or in a decode step once it has FAULT_AFTER
tokens ("decode": time for the test to queue others). A module of its own: TorchServe
wants one class in the handler's file (tests/fault_handler.py)."""

import json

from serving import InFlight

FAULT = "[test fault: {}]"
FAULT_AFTER = 32


class InjectedFault(BaseException):
    """Not an Exception, as a tokenizer's Rust panic (pyo3's PanicException) is not."""


def asks(where: str, inputs) -> bool:
    return FAULT.format(where) in json.dumps(inputs)


class FaultyInFlight(InFlight):
    def new_job(self, req_id: str, route: str, raw) -> tuple:
        job = super().new_job(req_id, route, raw)
        if asks("preprocess", job[0].inputs):
            raise InjectedFault("injected fault in preprocess")
        return job

    def message(self, job):
        finished = job.error is None and not job.request.stream and all(s.done for s in job.seqs)
        if finished and asks("answer", job.request.inputs):
            raise InjectedFault("injected fault in answer")
        return super().message(job)
