"""Write a model-config.yaml for one deployment, from the repository's, with the choices
`make serve` takes (TP, THREADS, CKPT, SET) and the ports the tests pick, after checking
that the checkpoint, the tokenizer and the settings can be served: what would make every
worker fail to load is refused here, in seconds, with one line naming the problem.

    python tools/configure.py --out build/model-config.yaml --tp 4 --checkpoint /models/llama-2-13b
"""

import argparse
import os
import sys
import warnings

import yaml

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch runs without it
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import chat_format  # noqa: E402
import checkpoint  # noqa: E402
import quant  # noqa: E402
from model import ModelArgs  # noqa: E402
from serving_config import ServingConfig  # noqa: E402
from tokenizer import Tokenizer, tokenizer_file  # noqa: E402
from tp import head_ranges  # noqa: E402

# Beyond the tokenizer's vocabulary, a checkpoint's embedding may hold this many padding rows
# (a pad token, a size rounded up to a multiple of 64 or 128); more is another vocabulary.
VOCAB_PADDING = 256
# startupTimeout (s) at least, with handler.compile: a first compile, with inductor's cache empty,
# took 10 minutes and more for SmolLM2 quantized at batchSize 8 on 2 cores, past the 600 s that
# TorchServe then gives a worker before it kills and retries it (BENCHMARKS.md, llama.cpp section)
COMPILE_STARTUP_TIMEOUT = 1800


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
    return with_compile_time(config)


def with_compile_time(config: dict) -> dict:
    """config with startupTimeout raised to COMPILE_STARTUP_TIMEOUT where the handler compiles."""
    if config["handler"].get("compile") is True and config.get("startupTimeout", 0) < COMPILE_STARTUP_TIMEOUT:
        config["startupTimeout"] = COMPILE_STARTUP_TIMEOUT
    return config


def set_key(config: dict, assignment: str):
    """Apply one KEY=VALUE: a dotted key into config, a YAML value
    (handler.max_seq_len=4096, handler.defaults.temperature=0, batchSize=4)."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes KEY=VALUE, got {assignment!r}")
    *path, last = key.split(".")
    node = config
    for part in path:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(value)


def on_disk(path: str, weights: str | None) -> str | None:
    """Where a handler path is before archiving: absolute paths are served in place; relative
    ones are inside the archive, whose weights/ is the folder build_mar.py packs (None: unknown)."""
    if os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(weights, os.path.relpath(path, "weights"))) if weights else None


def check(config: dict, weights: str | None = None) -> str:
    """What was checked, in one line; or a ValueError naming the first problem that would make
    every rank fail to load: a setting the handler refuses (serving_config: an unknown key, a
    value of the wrong type or out of range); a checkpoint folder that is missing, in neither
    layout, incomplete or with a file cut short, an index that names files by path (outside
    the folder), a safetensors header whose tensors lie outside their file; a GGUF file cut
    short, of another architecture or with a tensor type or feature the model does not
    implement (gguf_checkpoint.py); a missing
    tokenizer or one whose vocabulary does not fit the model, or a chat template that fails on
    a sample dialog; a TP size that does not divide the model's heads, KV heads or FFN width
    (or more ranks than GPUs); a max_seq_len beyond the positions the model was made for.
    Reads the checkpoint's JSON files and file headers, no weights. The tokenizer is built
    here as the workers build it (tokenizer.Tokenizer: a GGUF file's own vocabulary when the
    checkpoint is one), so that what it refuses is refused here too."""
    settings, tp = ServingConfig.from_model_config(config), int(config["torchrun"]["nproc-per-node"])
    folder = on_disk(settings.checkpoint, weights)
    if folder is None:
        return f"not checked: {settings.checkpoint} is inside the archive (give --weights)"
    args, positions = checkpoint.inspect(folder)
    model = fitting_tp(args, folder, tp)  # the checkpoint's own facts first, the tokenizer's next
    tokenizer_path = on_disk(settings.tokenizer or settings.checkpoint, weights)
    try:
        tokenizer_path = tokenizer_file(tokenizer_path)  # a folder's tokenizer.json or tokenizer.model
    except FileNotFoundError as e:
        raise ValueError(f"{e} (give TOKENIZER=... or handler.tokenizer)") from None
    try:
        tokenizer = Tokenizer(tokenizer_path)
    except Exception as e:  # whatever the tokenizer library raises for a file it cannot read
        raise ValueError(f"cannot read the tokenizer {tokenizer_path}: {e}") from None
    n_words = tokenizer.n_words
    try:  # a template that fails on a plain exchange would fail every chat request
        chat_format.check_template(tokenizer)
    except ValueError as e:
        raise ValueError(f"{e} (rendering a sample dialog with the chat template beside {tokenizer_path})") from None
    vocab = args["vocab_size"]
    if vocab > 0 and not n_words <= vocab < n_words + VOCAB_PADDING:
        raise ValueError(f"the tokenizer {tokenizer_path} has {n_words} tokens, the model in {folder} "
                         f"{vocab}: they are not the same vocabulary")

    draft = settings.speculative.draft and on_disk(settings.speculative.draft, weights)
    if draft:  # a draft model in the archive is checked when the workers load it
        draft_args, _ = checkpoint.inspect(draft)
        if draft_args["vocab_size"] != vocab:
            raise ValueError(f"the draft model in {draft} has {draft_args['vocab_size']} tokens, the model in "
                             f"{folder} {vocab}: handler.speculative.draft must share the tokenizer")
        fitting_tp(draft_args, draft, tp)
    max_seq_len = settings.max_seq_len
    if positions and max_seq_len > positions:
        raise ValueError(f"handler.max_seq_len {max_seq_len} is beyond the {positions} positions the model "
                         f"in {folder} was made for (config.json max_position_embeddings, a GGUF file's "
                         f"context_length)")
    if settings.quantization_mode:
        on = "cuda" if config.get("deviceType") == "gpu" else "cpu"
        quant.check_device(settings.quantization_mode, torch.device(on))
    if settings.kv_cache_memory and config.get("deviceType") != "gpu":
        raise ValueError(f"handler.kv_cache_memory {settings.kv_cache_memory} is a share of a GPU's free memory, "
                         "and this deployment runs on the CPU: give handler.kv_cache_bytes")
    if config.get("deviceType") == "gpu" and torch.cuda.device_count() < tp:
        raise ValueError(f"TP={tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    return (f"checked {folder}: {model.n_layers} layers, {model.n_heads} heads, {model.n_kv_heads} KV heads, FFN width "
            f"{model.ffn_hidden_dim}, vocabulary {vocab if vocab > 0 else n_words}; tokenizer: {n_words} tokens; "
            f"TP={tp}")


def fitting_tp(args: dict, folder: str, tp: int) -> ModelArgs:
    """The model's arguments; a ValueError if TP does not divide its heads, KV heads or FFN width."""
    model = ModelArgs(**args)
    try:
        for rank in range(tp):
            head_ranges(model, rank, tp)
    except ValueError as e:
        raise ValueError(f"TP={tp} does not fit the model in {folder} ({model.n_heads} heads, "
                         f"{model.n_kv_heads} KV heads): {e}") from None
    if model.ffn_hidden_dim % tp:
        raise ValueError(f"TP={tp} does not fit the model in {folder}: its FFN width {model.ffn_hidden_dim} "
                         f"cannot be split over {tp} ranks")
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=os.path.join(ROOT, "model-config.yaml"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int)
    ap.add_argument("--threads", type=int, help="CPU threads per rank")
    ap.add_argument("--checkpoint", help="a Meta or Hugging Face folder, or a GGUF file, served in place (not copied)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--weights", help="the folder build_mar.py packs into the archive as weights/ (to check it)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other setting, e.g. handler.max_seq_len=4096 (repeatable)")
    ap.add_argument("--device", choices=["cpu", "gpu", "auto"], default="auto")
    ap.add_argument("--quant", choices=["none", *quant.MODES], help="handler.quantization")
    a = ap.parse_args()
    device = a.device
    if device == "auto":
        device = "gpu" if torch.cuda.is_available() else "cpu"
    with open(a.base) as f:
        config = configure(yaml.safe_load(f), a.tp, a.checkpoint, a.tokenizer, device, threads=a.threads,
                           handler={"quantization": a.quant} if a.quant else None)
    try:
        for assignment in a.set:
            set_key(config, assignment)
        with_compile_time(config)
        print(check(config, a.weights))
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        sys.exit(f"cannot serve: {e}")
    except KeyError as e:
        sys.exit(f"cannot serve: a setting the checkpoint or config needs is missing: {e}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)


if __name__ == "__main__":
    main()
