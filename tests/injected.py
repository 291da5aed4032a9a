"""The faults tests/fault_handler.py injects: a request whose prompt holds FAULT.format(where)
raises there, so that a test can show what a bug costs: while it is read ("preprocess"),
while its answer is formatted ("answer"), or in a decode step once it has FAULT_AFTER
tokens ("decode": time for the test to queue others). A module of its own: TorchServe
wants one class in the handler's file."""

import json

FAULT = "[test fault: {}]"
FAULT_AFTER = 32


class InjectedFault(BaseException):
    """Not an Exception, as a tokenizer's Rust panic (pyo3's PanicException) is not."""


def asks(where: str, inputs) -> bool:
    return FAULT.format(where) in json.dumps(inputs)
