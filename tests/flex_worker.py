"""FlexAttention in a process of its own, for test_attention.py, forked by
tests/torchrun.output_of (its zygote has imported torch and our modules, and compiled nothing):

    flex_worker.py first-step FOLDER
        the process's first flex step decodes 16 rows (eager, on a pool of 128 blocks): prints
        the largest difference from gather + SDPA's logits
    flex_worker.py load FOLDER ATTENTION MAX_SEQ_LEN
        loads FOLDER as a worker does (loading.load) with handler.attention ATTENTION: prints
        whether flex_attention compiled a graph of its own
"""

import os
import sys

import flex_attention
import llama2
import loading
from batch import Batch
from serving_config import ServingConfig
from tp_worker import max_diff


def first_step(folder: str) -> float:
    logits = {}
    for attention in ("flex", "sdpa"):
        runner = llama2.tp_llama(None, folder, None, 1, max_batch_size=16, max_seq_len=128,
                                 attention=attention).runner
        batch = Batch(tokens=[], positions=[], slots=[])
        for row in range(16):  # 16 decode rows of 40 tokens: the count whose graph failed in inductor
            batch.add([5 + row], 39, [3 * row, 3 * row + 1, 3 * row + 2], runner.block_size, decode=True)
        logits[attention] = runner.forward_batch(batch)
    return max_diff(logits["flex"], logits["sdpa"])


def loaded(folder: str, attention: str, max_seq_len: int) -> bool:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    loading.load(ServingConfig(checkpoint=folder, attention=attention, max_seq_len=max_seq_len), root, 4, 1,
                 lambda *args, **kwargs: None)
    return flex_attention.has_graph()


if __name__ == "__main__":
    if sys.argv[1] == "first-step":
        print(first_step(sys.argv[2]))
    else:
        print(loaded(sys.argv[2], sys.argv[3], int(sys.argv[4])))
