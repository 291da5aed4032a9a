"""One tensor-parallel rank of test_quant.py, started by tests/torchrun.py:

    quant_worker.py OUT_DIR MODE PROMPT...

loads the demo model on WORLD_SIZE ranks with quantization MODE and saves this rank's greedy
tokens (with their logprobs) for each prompt to OUT_DIR/rank{r}.pt."""

import os
import sys

import torch
import torch.distributed as dist

import generate
import llama2
from conftest import DEMO
from test_quant import N_NEW


def main():
    out_dir, mode, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
    llama = llama2.tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), int(os.environ["WORLD_SIZE"]),
                            max_batch_size=len(prompts), max_seq_len=128, quantization=mode)
    tokens = [llama.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    greedy, logprobs = generate.generate(llama.runner, tokens, N_NEW, temperature=0, logprobs=True,
                                         tokenizer=llama.tokenizer)
    torch.save({"greedy": greedy, "logprobs": logprobs}, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
