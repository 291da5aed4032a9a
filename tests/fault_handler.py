"""The handler of the tests' shared TorchServe (conftest.server): LlamaHandler, with the
faults of tests/injected.py where a prompt asks for one."""

from handler import LlamaHandler
from injected import FAULT_AFTER, InjectedFault, asks


class FaultyHandler(LlamaHandler):
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

    def start_steps(self):
        long_enough = [j.request.inputs for j in self.jobs.values()
                       if any(not s.done and len(s.tokens) >= FAULT_AFTER for s in j.seqs)]
        if self.engine.running and asks("decode", long_enough):
            self.engine.start(fail_a_step)  # on every rank alike: the jobs are the same
        else:
            super().start_steps()


def fail_a_step():
    raise RuntimeError("injected fault in decode")
