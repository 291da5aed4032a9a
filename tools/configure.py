"""Write a model-config.yaml for one deployment, from the repository's, with the choices
`make serve` takes (TP, THREADS, CKPT) and the ports the tests pick.

    python tools/configure.py --out build/model-config.yaml --tp 4 --checkpoint /models/llama-2-13b
"""

import argparse
import os
import warnings

import yaml


def configure(base: dict, tp: int | None = None, checkpoint: str | None = None, tokenizer: str | None = None,
              device: str | None = None, rdzv_port: int | None = None, batch_size: int | None = None,
              handler: dict | None = None, threads: int | None = None) -> dict:
    config = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    if tp:
        config["torchrun"]["nproc-per-node"] = tp
    if threads:  # TorchServe starts each rank with OMP_NUM_THREADS set to this
        config["torchrun"]["OMP_NUMBER_THREADS"] = threads
    if rdzv_port:  # keeps this server's ranks apart from any other torchrun on the machine
        config["torchrun"]["rdzv-endpoint"] = f"127.0.0.1:{rdzv_port}"
    if device:
        config["deviceType"] = device
    if batch_size:
        config["batchSize"] = batch_size
    if checkpoint:
        config["handler"]["checkpoint"] = os.path.abspath(checkpoint)
        config["handler"]["tokenizer"] = os.path.abspath(tokenizer or checkpoint)
    for key, value in (handler or {}).items():
        config["handler"][key] = value
    return config


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=os.path.join(os.path.dirname(__file__), "..", "model-config.yaml"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int)
    ap.add_argument("--threads", type=int, help="CPU threads per rank")
    ap.add_argument("--checkpoint", help="a Meta or Hugging Face folder served in place (not copied)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--device", choices=["cpu", "gpu", "auto"], default="auto")
    ap.add_argument("--quant", choices=["none", "int8", "int4"], help="handler.quantization")
    a = ap.parse_args()
    device = a.device
    if device == "auto":
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch runs without it
        import torch
        device = "gpu" if torch.cuda.is_available() else "cpu"
    with open(a.base) as f:
        config = configure(yaml.safe_load(f), a.tp, a.checkpoint, a.tokenizer, device, threads=a.threads,
                           handler={"quantization": a.quant} if a.quant else None)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)


if __name__ == "__main__":
    main()
