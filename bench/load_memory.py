"""Peak resident memory per rank while tp_llama loads a checkpoint of about 400 MB (fp32).

    python bench/load_memory.py [--dim 1024 --layers 8 --heads 16 --kv-heads 8] [--layouts meta hf]
                                [--quantizations none int8 int4]
    python bench/load_memory.py --gguf [FILE ...]

writes a random checkpoint (Meta layout MP=1 and/or Hugging Face safetensors), loads it with
llama2.tp_llama at TP=1 (a plain process) and TP=2 (torchrun, gloo, CPU), unquantized and
quantized at load (tp_llama(quantization=...)), and writes a table into BENCHMARKS.md between
the load_memory markers. --gguf writes the random checkpoint as an F32 GGUF file instead and
also loads each FILE (GGUF) at every TP up to 3 that divides its heads, into the
load_memory_gguf section. Each rank reports, from /proc/self/status:

  VmHWM    peak resident set (the kernel's high-water mark, reset after imports). It counts
           the clean page-cache pages of the memory-mapped checkpoint that the rank touched.
  RssAnon  private memory (parameters, temporaries); its peak is sampled every millisecond
           by a thread and after loading.

The KV cache is sized to 1 x 256 positions (model_args) so that it does not hide the
weights; its size is listed separately.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import report  # noqa: E402
TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")
MB = 1 << 20


# --- /proc ------------------------------------------------------------------------------

def status() -> dict:
    """Memory fields of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler(threading.Thread):
    """Samples RssAnon and RssFile every `interval` seconds and keeps their peaks."""

    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval, self.peak, self.running = interval, {"RssAnon": 0, "RssFile": 0}, True

    def sample(self):
        s = status()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], s[key])

    def run(self):
        while self.running:
            self.sample()
            time.sleep(self.interval)

    def stop(self) -> dict:
        self.running = False
        self.join()
        self.sample()
        return self.peak


# --- one rank -----------------------------------------------------------------------------

def measure(folder: str, out_dir: str, quantization: str):
    """Load folder with tp_llama on WORLD_SIZE ranks (this is one of them), quantized unless
    quantization is "none", and save this rank's figures to out_dir/rank{r}.json."""
    import torch

    import collectives
    import llama2
    import tp

    world_size = int(os.environ.get("WORLD_SIZE", 1))

    # One-time costs that do not grow with the checkpoint stay out of the figures: the
    # first model built on the meta device imports ~800 modules of torch (~65 MB), and
    # joining the process group starts gloo.
    first_use = status()
    with torch.device("meta"):
        llama2.Transformer(llama2.ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32))
    tp.init_distributed(world_size)
    warm = status()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    before = status()
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    llama = llama2.tp_llama(None, folder, TOKENIZER, world_size, max_batch_size=1, max_seq_len=256,
                            quantization=None if quantization == "none" else quantization)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    after = status()

    trimmed = malloc_trim()
    model = llama.model
    caches = [t for layer in model.layers for t in (layer.attention.cache_k, layer.attention.cache_v)]
    rank = collectives.tp_world()[0]
    # quantized weights and scales are buffers; the rotary table is not a weight
    weights = [*model.parameters(), *(b for name, b in model.named_buffers() if name != "freqs_cis")]
    result = {"rank": rank, "world_size": world_size, "seconds": seconds, "quantization": quantization,
              "shard": sum(t.numel() * t.element_size() for t in weights),
              "kv_cache": sum(t.numel() * t.element_size() for t in caches),
              "warm_up": warm["RssAnon"] - first_use["RssAnon"], "before": before, "after": after, "peak_anon": peak["RssAnon"], "peak_file": peak["RssFile"],
              "hwm": after["VmHWM"], "trimmed": trimmed["RssAnon"],
              "spanned": spanned_bytes(folder, tp.weight_plan(llama2.meta_shard(model.params, world_size), rank,
                                                              world_size))}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if world_size > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def malloc_trim() -> dict:
    """status() after glibc returns the free memory it holds to the system (where it can)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return status()


def spanned_bytes(folder: str, plan: dict) -> int:
    """Bytes of the checkpoint's pages that the slices in plan lie on: what a rank must
    fault in, at least, to read its shard through the memory map. Computed from the
    views' addresses, without reading them (single-file checkpoints: Meta MP=1, one
    safetensors file or a GGUF file)."""
    import checkpoint
    import gguf_checkpoint

    reader = checkpoint.open_checkpoint(folder)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = set()
    for pieces in plan.values():
        for piece in pieces:
            if isinstance(reader, gguf_checkpoint.GGUFCheckpoint):
                rows = reader.blocks(piece).data  # (rows, bytes)
                start, row_bytes, stride = rows.ctypes.data, rows.shape[1], rows.strides[0]
            else:
                if isinstance(reader, checkpoint.MetaCheckpoint):
                    t = reader.shards[0][piece.name]
                else:
                    name = checkpoint.hf_name(piece.name, reader.tied)
                    t = reader.location[name].tensor(name)
                t = checkpoint.narrow(t, piece)
                rows = t.view(-1, t.shape[-1]) if t.dim() > 1 else t.view(1, -1)
                start, row_bytes = rows.data_ptr(), rows.shape[1] * rows.element_size()
                stride = rows.stride(0) * rows.element_size()
            for r in range(rows.shape[0]):
                at = start + r * stride
                pages.update(range(at // page, (at + row_bytes - 1) // page + 1))
    return len(pages) * page


# --- the checkpoint -----------------------------------------------------------------------

def write_checkpoint(out: str, dim: int, layers: int, heads: int, kv_heads: int, layouts: list[str]):
    """Random fp32 weights in Meta layout (params.json + consolidated.00.pth), Hugging Face
    layout (config.json + model.safetensors) and/or an F32 GGUF file (model.gguf); returns
    ({layout: folder or file}, bytes, ModelArgs)."""
    import torch
    from safetensors.torch import save_file

    import checkpoint
    import llama2
    import tp
    from tokenizer import Tokenizer

    vocab = Tokenizer(TOKENIZER).n_words
    args = llama2.ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, vocab_size=vocab)
    with torch.device("meta"):
        model = llama2.Transformer(args)
    shapes = {p.name: p.shape for pieces in tp.weight_plan(model, 0, 1).values() for p in pieces}
    gen = torch.Generator().manual_seed(0)
    state = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * dim ** -0.5)
             for name, shape in shapes.items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    folders = {}
    if "meta" in layouts:
        folder = os.path.join(out, "meta")
        os.makedirs(folder)
        torch.save(state, os.path.join(folder, "consolidated.00.pth"))
        with open(os.path.join(folder, "params.json"), "w") as f:
            json.dump({"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv_heads,
                       "vocab_size": vocab, "multiple_of": args.multiple_of, "norm_eps": args.norm_eps}, f)
        folders["meta"] = folder
    if "hf" in layouts:
        folder = os.path.join(out, "hf")
        os.makedirs(folder)
        save_file({checkpoint.hf_name(k, False): v for k, v in state.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"model_type": "llama", "hidden_size": dim, "num_hidden_layers": layers,
                       "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
                       "intermediate_size": args.ffn_hidden_dim, "rms_norm_eps": args.norm_eps,
                       "rope_theta": args.rope_theta, "tie_word_embeddings": False}, f)
        folders["hf"] = folder
    if "gguf" in layouts:
        path = os.path.join(out, "model.gguf")
        write_gguf(path, args, state)
        folders["gguf"] = path
    return folders, size, args


def write_gguf(path: str, args, state: dict):
    """state (Meta names and layout, which are GGUF's q and k rows' too) as an F32 GGUF file."""
    import gguf

    import gguf_checkpoint
    import make_checkpoint

    metadata = {"general.architecture": "llama", "llama.block_count": args.n_layers,
                "llama.embedding_length": args.dim, "llama.feed_forward_length": args.ffn_hidden_dim,
                "llama.attention.head_count": args.n_heads, "llama.attention.head_count_kv": args.n_kv_heads,
                "llama.attention.layer_norm_rms_epsilon": args.norm_eps, "llama.rope.freq_base": args.rope_theta,
                "llama.vocab_size": args.vocab_size}
    f32 = gguf.GGMLQuantizationType.F32
    make_checkpoint.write_gguf(path, metadata, {gguf_checkpoint.gguf_name(name, False): (t.numpy(), f32)
                                                for name, t in state.items()})


# --- the driver ---------------------------------------------------------------------------

def run_ranks(folder: str, world_size: int, quantization: str) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="load_memory_")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    me = [os.path.abspath(__file__), "--measure", folder, out_dir, quantization]
    if world_size == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", *me]
    subprocess.run(cmd, env=env, check=True)
    results = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    shutil.rmtree(out_dir)
    return results


def table(rows: list[tuple[str, int, dict]]) -> str:
    def mb(n):
        return f"{n / MB:.0f}"

    lines = ["| layout | TP | weights | rank | shard kept | KV cache | checkpoint pages its slices span | "
             "before: RssAnon / VmRSS | peak RssAnon − before | RssAnon after malloc_trim − before | "
             "peak RssFile − before | **VmHWM − before** | load (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout, ws, r in rows:
        b = r["before"]
        lines.append(f"| {layout} | {ws} | {r['quantization']} | {r['rank']} | {mb(r['shard'])} | "
                     f"{mb(r['kv_cache'])} | {mb(r['spanned'])} | "
                     f"{mb(b['RssAnon'])} / {mb(b['VmRSS'])} | {mb(r['peak_anon'] - b['RssAnon'])} | "
                     f"{mb(r['trimmed'] - b['RssAnon'])} | {mb(r['peak_file'] - b['RssFile'])} | "
                     f"**{mb(r['hwm'] - b['VmRSS'])}** | {r['seconds']:.1f} |")
    return "\n".join(lines)


def summary(rows: list[tuple[str, int, dict]], row_bytes: dict) -> str:
    """What the table says, with its own figures; row_bytes: {weight: bytes of one row}."""
    def span(values):
        lo, hi = min(values) / MB, max(values) / MB
        return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"

    rs = [r for _, _, r in rows]
    max_off = max(abs(r["trimmed"] - r["before"]["RssAnon"] - r["shard"] - r["kv_cache"]) for r in rs) / MB
    tp1 = [r for _, ws, r in rows if ws == 1 and r["quantization"] == "none"]
    tp2 = [r for _, ws, r in rows if ws == 2 and r["quantization"] == "none"]
    text = [
        "Reading the table:",
        f"- Private memory is the shard. After loading (and malloc_trim), RssAnon has grown by the shard kept plus "
        f"the KV cache, to within {max_off:.0f} MB on every rank. The peak is up to "
        f"{span([max(r['peak_anon'] - r['trimmed'], 0) for r in rs])} MB higher: temporaries (the copy that the "
        f"rotary un-permutation makes of Hugging Face q/k rows, GGUF blocks dequantized a chunk at a time), whose "
        f"memory glibc keeps after they are freed.",
        "- VmHWM also counts the checkpoint pages that the rank faulted in through its memory map (RssFile). They "
        "are clean page-cache pages, one copy shared by all ranks of the host and reclaimable, but they stay "
        "mapped, so the per-rank peak RSS is about the shard plus what was read"
        + (f": the whole file at TP=1 ({span([r['peak_file'] - r['before']['RssFile'] for r in tp1])} MB)" if tp1 else "")
        + (f", {span([r['peak_file'] - r['before']['RssFile'] for r in tp2])} MB per rank at TP=2." if tp2 else "."),
    ]
    if tp2:
        text.append(
            f"- At TP=2 a rank keeps {span([r['shard'] for r in tp2])} MB but its slices lie on "
            f"{span([r['spanned'] for r in tp2])} MB of checkpoint pages (computed from the slices' addresses). "
            "The row-parallel weights (wo, w2) are split along dim 1, so a rank's slice is half of every row, "
            f"and with rows of {row_bytes['wo']} and {row_bytes['w2']} bytes (pages of {os.sysconf('SC_PAGE_SIZE')}) "
            "the half-rows lie on most pages of those tensors: up to one extra page at each end of each row's slice. The rest of the RssFile peak is the kernel mapping neighbouring "
            "page-cache pages on each fault (fault-around, large folios). Private memory is not affected: "
            "each slice is copied straight into its rows of the rank's parameter (Checkpoint.load_into).")
    text += quantized_summary(rows)
    text.append(
        "- Not done, possible: after copying each parameter, Checkpoint.load_into could "
        "madvise(MADV_DONTNEED) the pages of the source tensors (clean, private, file-backed: they are only "
        "unmapped and stay in the page cache), which would bring VmHWM down to about the shard, the KV cache "
        "and one tensor's pages; the reading itself, page by page, stays as it is.")
    return "\n".join(text)


def quantized_summary(rows: list[tuple[str, int, dict]]) -> list[str]:
    """Each quantized rank against the same layout, TP and rank unquantized: its resident
    weights (targets: int8 at most 30% of fp32, int4 at most 20%) and its private memory."""
    fp32 = {(layout, ws, r["rank"]): r for layout, ws, r in rows if r["quantization"] == "none"}
    text = []
    for q in ("int8", "int4"):
        pairs = [(r, fp32[layout, ws, r["rank"]]) for layout, ws, r in rows
                 if r["quantization"] == q and (layout, ws, r["rank"]) in fp32]
        if not pairs:
            continue

        def pct(key, base_key=None):
            values = [100 * (r[key] - r["before"]["RssAnon"] if base_key else r[key])
                      / (f[key] - f["before"]["RssAnon"] if base_key else f[key]) for r, f in pairs]
            lo, hi = min(values), max(values)
            return f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}%"

        text.append(
            f"- {q}: a rank's resident weights (parameters and buffers: quantized projections with their scales, the "
            f"embedding and norms in fp32) are {pct('shard')} of the same rank's fp32 weights"
            f" (target: at most {30 if q == 'int8' else 20}%); its private memory after loading (RssAnon after "
            f"malloc_trim − before, the KV cache included) {pct('trimmed', True)}, and its peak private memory "
            f"while loading {pct('peak_anon', True)} of fp32's: tp_llama reads and quantizes one projection at a "
            "time, so the peak is the quantized model plus one projection in fp32 and the temporaries of reading "
            "and quantizing it, and what glibc keeps of freed temporaries (int4 makes an int32 copy of each "
            "projection before packing it). The embedding stays in fp32, split over the ranks' vocabulary "
            "like the output projection.")
    return text


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        return measure(sys.argv[2], sys.argv[3], sys.argv[4])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layouts", nargs="+", default=["meta", "hf"], choices=["meta", "hf"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"], choices=["none", "int8", "int4"])
    ap.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    ap.add_argument("--gguf", nargs="*", metavar="FILE",
                    help="the GGUF section: the random checkpoint as an F32 GGUF file, and each FILE")
    a = ap.parse_args()
    if a.gguf is not None:
        return gguf_section(a)

    tmp = tempfile.mkdtemp(prefix="load_memory_ckpt_")
    try:
        folders, size, args = write_checkpoint(tmp, a.dim, a.layers, a.heads, a.kv_heads, a.layouts)
        rows = []
        for layout, folder in folders.items():
            for ws in a.world_sizes:
                for q in a.quantizations:
                    rows += [(layout, ws, r) for r in run_ranks(folder, ws, q)]
    finally:
        shutil.rmtree(tmp)
    row_bytes = {"wo": args.dim * 4, "w2": args.ffn_hidden_dim * 4}  # fp32
    section = (f"## Checkpoint loading: peak resident memory per rank\n\n"
               f"`python bench/load_memory.py` — {report.header()}.\n\n"
               f"Random fp32 checkpoint of {size / MB:.0f} MB: dim {a.dim}, {a.layers} layers, {a.heads} heads, "
               f"{a.kv_heads} KV heads, vocabulary of demo/tokenizer.model; Meta layout (MP=1, "
               f"consolidated.00.pth) and Hugging Face layout (one model.safetensors). TP=2 runs under torchrun "
               f"(gloo, CPU). \"before\" is the rank's memory just before tp_llama (after imports); "
               f"VmHWM is reset there (/proc/self/clear_refs). Figures in MB.\n\n{table(rows)}\n\n"
               f"{summary(rows, row_bytes)}\n")
    report.publish("load_memory", section, not a.no_write)


def gguf_section(a):
    """The random checkpoint as an F32 GGUF file at --world-sizes, and each --gguf file at every
    TP up to 3 that fits its heads, into the load_memory_gguf section."""
    tmp = tempfile.mkdtemp(prefix="load_memory_ckpt_")
    try:
        files, size, _ = write_checkpoint(tmp, a.dim, a.layers, a.heads, a.kv_heads, ["gguf"])
        rows = [("random, F32 GGUF", ws, r) for ws in a.world_sizes for q in a.quantizations
                for r in run_ranks(files["gguf"], ws, q)]
    finally:
        shutil.rmtree(tmp)
    for path in a.gguf:
        rows += [(os.path.basename(path), ws, r) for ws in fitting_world_sizes(path) for q in a.quantizations
                 for r in run_ranks(os.path.abspath(path), ws, q)]
    section = (f"## Checkpoint loading from GGUF: peak resident memory per rank\n\n"
               f"`python bench/load_memory.py --gguf {' '.join(a.gguf)}` — {report.header()}.\n\n"
               f"The random checkpoint above ({size / MB:.0f} MB: dim {a.dim}, {a.layers} layers, {a.heads} heads, "
               f"{a.kv_heads} KV heads) written as an F32 GGUF file, and "
               f"{', '.join(a.gguf) or 'no file'} at every TP up to 3 that fits its heads; columns as above, "
               f"figures in MB.\n\n{table(rows)}\n\n{gguf_summary(rows)}\n")
    report.publish("load_memory_gguf", section, not a.no_write)


def fitting_world_sizes(path: str) -> list[int]:
    import checkpoint
    import llama2
    import tp

    args = llama2.ModelArgs(**checkpoint.inspect(path)[0])

    def fits(ws: int) -> bool:
        try:
            for rank in range(ws):
                tp.head_ranges(args, rank, ws)
        except ValueError:
            return False
        return args.ffn_hidden_dim % ws == 0

    return [ws for ws in (1, 2, 3) if fits(ws)]


def gguf_summary(rows: list[tuple[str, int, dict]]) -> str:
    """Each rank's peak resident memory against its shard (target at TP=2: at most 1.2 times)."""
    lines = ["Peak resident memory (VmHWM − before, the KV cache included) over the shard the rank keeps:"]
    for layout, ws, r in rows:
        ratio = (r["hwm"] - r["before"]["VmRSS"]) / r["shard"]
        lines.append(f"- {layout}, TP={ws}, rank {r['rank']}, {r['quantization']}: {ratio:.2f}"
                     + (f" (target at TP=2: at most 1.20: {'met' if ratio <= 1.2 else 'NOT met'})" if ws == 2 else ""))
    extra = {layout: max(r["peak_anon"] - r["before"]["RssAnon"] - r["shard"] - r["kv_cache"]
                         for lay, _, r in rows if lay == layout) / MB
             for layout, _, _ in rows}
    lines.append("\nPrivate memory at its peak beyond the shard and the KV cache, the most over the ranks: "
                 + "; ".join(f"{layout}: {mb:.0f} MB" for layout, mb in extra.items())
                 + ". Dequantizing a chunk of rows at a time keeps the temporaries small (the random file has no "
                 "vocabulary); a file that holds its tokenizer pays for GGUFReader's parse of its metadata, an "
                 "object per token and merge, freed with the reader once read (gguf_checkpoint.GGUFCheckpoint) "
                 "but in part still resident, at every TP alike.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
