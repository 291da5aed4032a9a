"""A tensor-parallel rank for test_llama3.py, started by tests/torchrun.py:

    logits_worker.py OUT_DIR [--tokenizer PATH] FOLDER [FOLDER ...]

loads each FOLDER (or GGUF file) with llama2.tp_llama on WORLD_SIZE ranks (its own
tokenizer, or PATH) and saves {folder: logits of long_tokens()} to OUT_DIR/rank{r}.pt."""

import os
import sys

import torch

SEQLEN = 100


def long_tokens(vocab_size: int) -> torch.Tensor:
    """The (1, SEQLEN) input of every rank and of the in-process run."""
    return torch.randint(0, vocab_size, (1, SEQLEN), generator=torch.Generator().manual_seed(3))


def main():
    import torch.distributed as dist

    import llama2

    out_dir, folders = sys.argv[1], sys.argv[2:]
    tokenizer = None
    if folders[0] == "--tokenizer":
        tokenizer, folders = folders[1], folders[2:]
    world_size = int(os.environ["WORLD_SIZE"])
    result = {}
    for folder in folders:
        runner = llama2.tp_llama(None, folder, tokenizer, world_size, max_batch_size=1, max_seq_len=SEQLEN).runner
        result[folder] = runner(long_tokens(runner.vocab_size), 0)
    rank = dist.get_rank()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
