"""One tensor-parallel rank of test_generate_tp.py, started by tests/torchrun.py:

    generate_worker.py OUT_DIR SPEC_JSON

SPEC_JSON names the checkpoint folder, the prompts, the cache size and the number of new
tokens. Every rank seeds its global RNG differently, so sampled tokens agree across ranks
only because rank 0's are broadcast. Saves this rank's results to OUT_DIR/rank{rank}.pt."""

import json
import os
import sys

import torch
import torch.distributed as dist

import generate as G
import sequence
from engine import Engine
import llama2


def main():
    out_dir, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    world_size = int(os.environ["WORLD_SIZE"])
    folder = spec["folder"]
    llama = llama2.tp_llama(None, folder, os.path.join(folder, "tokenizer.model"), world_size,
                            max_batch_size=spec["max_batch_size"], max_seq_len=spec["max_seq_len"])
    rank = dist.get_rank()
    model, tok = llama.runner, llama.tokenizer
    torch.manual_seed(1000 + rank)
    n = spec["n_new"]
    prompts = [tok.encode(p, bos=True, eos=False) for p in spec["prompts"]]
    res = {"rank": rank, "world_size": world_size}

    res["greedy"], res["greedy_logprobs"] = G.generate(model, prompts, n, temperature=0, logprobs=True, tokenizer=tok)
    res["echo"], res["echo_logprobs"] = G.generate(model, prompts, n, temperature=0, logprobs=True, echo=True,
                                                   tokenizer=tok)
    # sampled without a seed: the global RNG, different on every rank
    res["sampled"], res["sampled_logprobs"] = G.generate(model, prompts, n, temperature=1.0, top_p=1.0,
                                                         logprobs=True, tokenizer=tok)
    out = G.text_completion(model, tok, spec["prompts"], n, temperature=0.8, top_p=0.95, top_k=40)
    res["text_sampled"] = [o["generation"] for o in out]
    res["text_finish"] = [o["finish_reason"] for o in out]
    # a per-request seed, the same on every rank
    out = G.text_completion(model, tok, spec["prompts"], n, temperature=1.0, top_p=1.0, seed=7)
    res["text_seeded"] = [o["generation"] for o in out]
    # the Engine with sequences joining at different times, sampled
    eng = Engine(model, tok)
    params = sequence.SamplingParams(max_gen_len=n, temperature=1.0, top_p=0.9)
    seqs = [eng.add(prompts[0], params)]
    for p in prompts[1:]:
        eng.step()
        eng.step()
        seqs.append(eng.add(p, params))
    while eng.running:
        eng.step()
    res["engine_sampled"] = [s.tokens for s in seqs]
    # chat in the Llama-2 layout
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": spec["prompts"][0]}]
    out = G.chat_completion(model, tok, [dialog], n, temperature=1.0, top_p=0.9)
    res["chat_sampled"] = [o["generation"]["content"] for o in out]

    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
