"""One worker's tensor-parallel ranks: kept in step, or the worker exits for a restart.

torchrun starts one worker per rank, and TorchServe sends every rank each batch, but only
rank 0's answers go out, and the other ranks' copies cannot be relied on: TorchServe 0.12
writes each rank's copy from a thread of its own that reads the batch only when it runs
(WorkerThread.run), so a late one sends the batch after, or none, whenever rank 0 answers
without waiting for the others. So rank 0 leads: each iteration begins with rank 0 sending
the batch it got to the other ranks (broadcast_batch), which use it instead of their own
copy. Rank 0 cannot answer before every rank has received that, so each rank's copy is the
same batch, and every rank does the same work in the same order. Rank 0 also reads each
new request, renders and tokenizes it, and sends its token ids and settings (or only that
it was answered at once): what a chat template prints (a date) and how special-token text
is hidden are decided once, and the other ranks tokenize nothing.

Ranks that lost one of them, or whose collectives are out of step, will never decode right
again: the worker exits, and TorchServe fails the requests in flight ("Worker died.") and
starts a new one.
"""

import logging
import os
import pickle

import torch
import torch.distributed as dist

import collectives

logger = logging.getLogger(__name__)


def broadcast_batch(batch: list | None, group) -> list:
    """Rank 0's batch on every rank of group (the others pass None)."""
    try:  # pickle: rank 0's own objects, to the ranks of its own worker
        return pickle.loads(collectives.broadcast_bytes(None if batch is None else pickle.dumps(batch), group))
    except Exception:
        exit_for_a_restart("lost a rank")


def exit_if_broken(error: Exception, device: torch.device):
    """After a failed step: exit if the ranks can no longer reach each other (one died) or
    their collectives are out of step. Before answering: a worker that answers first goes
    back to TorchServe for more, and TorchServe 0.12 loses a request it takes from its
    queue just as the worker stops: that request is never answered."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if isinstance(error, collectives.OutOfStep):
        exit_for_a_restart("the tensor-parallel ranks are out of step")
    try:
        dist.all_reduce(torch.zeros(1, device=device))  # every rank failed alike: fine
    except Exception:
        exit_for_a_restart("the tensor-parallel ranks cannot reach each other")


def exit_for_a_restart(why: str):
    """This worker can no longer decode right: exit, and TorchServe fails the requests in
    flight ("Worker died.") and starts a new one."""
    logger.critical("%s; exiting so that TorchServe restarts the worker", why, exc_info=True)
    os._exit(1)
