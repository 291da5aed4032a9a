"""A rank of test_gguf.py's block test, started by tests/torchrun.py:

    blocks_worker.py OUT_DIR FILE QUANTIZATION TOKENIZER

loads the GGUF FILE on WORLD_SIZE ranks twice, in fp32 and with QUANTIZATION, and saves to
OUT_DIR/rank{r}.pt, for each projection of the quantized model, (its weight as its layer
computes with it, the fp32 model's weight it stands for)."""

import os
import sys

import torch


def weights(path: str, quantization: str | None, tokenizer: str, world_size: int) -> dict:
    import llama2
    from block_quant import BlockLinear

    model = llama2.tp_llama(None, path, tokenizer, world_size, max_batch_size=1, max_seq_len=32,
                            quantization=quantization).model
    if quantization is None:
        return {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return {name: m.dequantize() for name, m in model.named_modules() if isinstance(m, BlockLinear)}


def main():
    import torch.distributed as dist

    out_dir, path, quantization, tokenizer = sys.argv[1:5]
    world_size = int(os.environ["WORLD_SIZE"])
    full, quantized = weights(path, None, tokenizer, world_size), weights(path, quantization, tokenizer, world_size)
    torch.save({name: (w, full[name]) for name, w in quantized.items()}, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
