"""One rank of test_seeds.py's TP=2 test, started by tests/torchrun.py:

    seeds_worker.py OUT_DIR PTH_FILE DEMO_FOLDER

Runs every seed example on this rank (each rank samples with its own global RNG: the
answers agree only because rank 0's tokens are sent). Saves OUT_DIR/rank{rank}.pt."""

import os
import sys

import torch
import torch.distributed as dist

import generate as G
import seed_examples as ex
from llama2 import tp_llama


def main():
    out_dir, path, demo = sys.argv[1:4]
    world_size = int(os.environ["WORLD_SIZE"])
    tokenizer_path = os.path.join(demo, "tokenizer.model")
    llama = ex.seed000_example2(path, tokenizer_path, 4096, world_size)
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    tokens = torch.randint(0, 4096, (2, 10), generator=torch.Generator().manual_seed(7))
    res = {"parameters": ex.seed000_example1(4096), "logits": llama.model(tokens, 0)}
    _, logits, _ = ex.seed000_example3(4096, tokens)
    res["forward_shape"] = tuple(logits.shape)
    served = tp_llama(None, demo, tokenizer_path, world_size, max_batch_size=2, max_seq_len=512)
    prompt_tokens = [served.tokenizer.encode("The secret of life is", bos=True, eos=False)]
    res["greedy"], _ = G.generate(served.model, prompt_tokens, 16, temperature=0)
    res["texts"] = [t["generation"] for t in ex.seed002_example1(served.model, served.tokenizer)]
    res["chats"] = [c["generation"]["content"] for c in ex.seed002_example2(served.model, served.tokenizer)]
    res["sampled"] = ex.seed002_example3()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
