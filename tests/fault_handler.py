"""The handler of the tests' shared TorchServe (conftest.server): LlamaHandler, with the
faults of tests/injected.py where a prompt asks for one."""

from handler import LlamaHandler
from injected import FAULT_AFTER, FaultyInFlight, asks


class FaultyHandler(LlamaHandler):
    in_flight = FaultyInFlight  # faults while a request is read or answered

    def start_steps(self):
        long_enough = [j.request.inputs for j in self.requests.jobs.values()
                       if any(not s.done and len(s.tokens) >= FAULT_AFTER for s in j.seqs)]
        if self.engine.running and asks("decode", long_enough):
            self.engine.start(fail_a_step)  # on every rank alike: the jobs are the same
        else:
            super().start_steps()


def fail_a_step():
    raise RuntimeError("injected fault in decode")
