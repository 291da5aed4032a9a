"""Decode tokens/s with a JSON schema against unconstrained, in one run (issue 30, item 5):
bench/structured.py's decode part, run by it (`python bench/structured.py`).

The in-process Engine (engine.py; TP=1, this process's threads, steps on the caller's
thread, prefix caching off so that every run computes the same) on bench/decode.py's random
110M shape (tools/make_checkpoint.py, seed 0, fp32, Meta layout), with two vocabularies:
demo/tokenizer.model's (4,096 tokens) and structured.py's trained 128k one (128,256 ids, as
Llama 3 has: the output projection and the masks then cost what they do on Llama 3).

Each row decodes greedily (as bench/decode.py does) from a 32-token prompt of random ids.
Constrained rows follow SCHEMA, whose every field is bounded (strings of bounded length,
enums, bounded integers, arrays of a fixed length), so that a random model's answer always
ends, by the grammar's end; unconstrained rows decode, with EOS ignored, exactly as many
tokens as the same row's constrained answer had (measured in a warm-up), so that both runs
decode the same tokens per row and shrink the batch at the same steps. Greedy, and prefix
caching off, every constrained run gives the same answers (the table says whether they
did). tokens/s = the tokens sampled in the decode steps / the wall time of those steps (the
first step, the prompts' prefill and the first tokens, is not counted). Rounds alternate
which side goes first; the medians over rounds are compared.

Greedy, because at temperature > 0 sampler.sample sorts each row's whole distribution, and a
row whose grammar leaves few tokens sorts mostly zeros, several times faster than a dense
row (sampling_ms measures that on the warm-up's own masks): the ratio would then measure
the sort, not what the constraint costs.

Mask overlap: Engine.step computes the constrained rows' bitmask on its masks thread while
the forward pass runs. TimedEngine observes it from outside (engine.py unchanged): whether
the mask's future was done when advance() (right after the forward pass) got the logits,
the mask's wall time (submitted to done), how long sampling waited for it, and advance()'s
own time (the wait, adjust_logits with apply_bitmask, the draw, the matchers' consume).
"""

import json
import os
import statistics
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
import llama2  # noqa: E402
import structured  # noqa: E402
from engine import Engine  # noqa: E402
from sampler import sample  # noqa: E402
from sequence import SamplingParams  # noqa: E402
from structured import Constraint  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO_TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")
SHAPE = ("110M", (768, 12, 12))  # bench/decode.py's: dim, layers, heads (= KV heads)
VOCABS = ("demo", "128k")
BATCHES = (1, 8)
PROMPT_LEN = 32
MAX_NEW = 256  # the constrained rows' max_gen_len by default: far above the schema's longest answer here
TARGET = 0.9  # batch 8: JSON-schema tokens/s at least this times unconstrained
SAMPLED_MASKS = 10  # warm-up masks that sampling_ms draws with

# every field bounded: a random model's answer ends within a bounded number of tokens
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "age", "unit", "tags", "scores", "active"], "properties": {
              "name": {"type": "string", "minLength": 1, "maxLength": 24},
              "city": {"type": "string", "minLength": 1, "maxLength": 16},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
              "tags": {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "string", "maxLength": 10}},
              "scores": {"type": "array", "minItems": 4, "maxItems": 4,
                         "items": {"type": "integer", "minimum": 0, "maximum": 100}},
              "active": {"type": "boolean"}}}
CONSTRAINT = Constraint("json_schema", SCHEMA)


@dataclass
class MaskStep:
    submitted: float
    forward_done: float = 0.0
    ready: bool = False  # done when the forward pass was
    done: float = 0.0
    bitmask: torch.Tensor | None = None  # kept with TimedEngine.keep


class TimedEngine(Engine):
    """The Engine, observed: while log is a dict, each step appends advance()'s time to
    log["advance_ms"] and, where its rows have a grammar, a MaskStep to log["masks"]."""

    log: dict | None = None
    keep = False  # keep each step's bitmask too
    _current: MaskStep | None = None

    def start_masks(self, seqs) -> Future | None:
        masks = super().start_masks(seqs)
        if masks is not None and self.log is not None:
            step = self._current = MaskStep(time.perf_counter())
            masks.add_done_callback(lambda _, step=step: setattr(step, "done", time.perf_counter()))
        return masks

    def advance(self, seqs, logits, masks=None):
        if self.log is None:
            return super().advance(seqs, logits, masks)
        start = time.perf_counter()
        step, self._current = self._current, None
        if masks is not None and step is not None:
            step.forward_done, step.ready = start, masks.done()
            self.log["masks"].append(step)
        super().advance(seqs, logits, masks)
        self.log["advance_ms"].append((time.perf_counter() - start) * 1e3)
        if self.keep and step is not None:
            step.bitmask = masks.result()


@dataclass
class Run:
    tokens: int  # sampled in the timed (decode) steps
    seconds: float
    lengths: list[int]  # each row's tokens
    texts: list[str]
    reasons: list[str]
    step_ms: list[float]
    advance_ms: list[float]
    masks: list[MaskStep] = field(default_factory=list)

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def decode(engine: TimedEngine, batch: int, lengths: list[int] | None, max_new: int) -> Run:
    """One greedy run of batch rows: constrained to SCHEMA (lengths None; at most max_new
    tokens), else unconstrained with EOS ignored, row i decoding lengths[i] tokens."""
    rows = prompts(batch, engine.runner.vocab_size)
    if lengths is None:
        params = [SamplingParams(max_gen_len=max_new, temperature=0.0, constraint=CONSTRAINT) for _ in rows]
    else:
        params = [SamplingParams(max_gen_len=n, temperature=0.0, ignore_eos=True) for n in lengths]
    seqs = [engine.add(p, q) for p, q in zip(rows, params)]
    engine.step()  # the prefill and each row's first token: not timed
    first = sum(len(s.tokens) for s in seqs)
    engine.log, steps = {"masks": [], "advance_ms": []}, []
    start = time.perf_counter()
    while engine.running:
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    seconds = time.perf_counter() - start
    log, engine.log = engine.log, None
    assert engine.pool.num_used == 0
    return Run(sum(len(s.tokens) for s in seqs) - first, seconds, [len(s.tokens) for s in seqs],
               [s.text for s in seqs], [s.finish_reason for s in seqs], steps, log["advance_ms"], log["masks"])


def sampling_ms(bitmasks: list[torch.Tensor], vocab_size: int) -> dict:
    """sampler.sample at temperature 1 (top_p 1) on rows of random logits: as they are, and
    masked by each of bitmasks (the engine's, from a constrained run); median ms."""
    rows = bitmasks[0].shape[0]
    seqs = [SimpleNamespace(params=SamplingParams(max_gen_len=1, temperature=1.0, top_p=1.0), generator=None)
            for _ in range(rows)]
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))

    def timed(x: torch.Tensor) -> float:
        start = time.perf_counter()
        sample(x, seqs)
        return (time.perf_counter() - start) * 1e3

    dense, masked = [], []
    for bitmask in bitmasks:
        dense.append(timed(logits))
        x = logits.clone()
        structured.apply_bitmask(x, bitmask)
        masked.append(timed(x))
    return {"rows": rows, "dense": statistics.median(dense), "masked": statistics.median(masked)}


def build(vocab: str, folder: str, cache: str) -> tuple[str, str]:
    """The random model's checkpoint folder and its tokenizer (a file or a folder)."""
    import make_checkpoint

    tokenizer = DEMO_TOKENIZER if vocab == "demo" else cache
    dim, layers, heads = SHAPE[1]
    hf = make_checkpoint.random_hf_model(dim, layers, heads, heads, Tokenizer(tokenizer).n_words, seed=0)
    ckpt = make_checkpoint.write_layouts(hf, folder, DEMO_TOKENIZER, ["meta:1"])["meta:1"]
    return ckpt, tokenizer


def valid(text: str) -> bool:
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:  # a test requirement: without it, JSON that parses
        return True
    try:
        jsonschema.validate(answer, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def measure(vocab: str, folder: str, cache: str, rounds: int, max_new: int) -> dict:
    """Both sides at each batch size, alternating for rounds after a warm-up of each."""
    ckpt, tokenizer = build(vocab, folder, cache)
    llama = llama2.tp_llama(None, ckpt, tokenizer, 1, max_batch_size=max(BATCHES), max_seq_len=PROMPT_LEN + max_new)
    engine = TimedEngine(llama.runner, llama.tokenizer, prefix_caching=False)
    start = time.perf_counter()
    engine.vocabulary  # llguidance's tokenizer: built at the first constraint, once
    vocabulary_s = time.perf_counter() - start
    compile_ms = []
    for _ in range(5):
        start = time.perf_counter()
        structured.compiled.__wrapped__(engine.vocabulary.ll, structured.grammar_text(CONSTRAINT))
        compile_ms.append((time.perf_counter() - start) * 1e3)
    out = {"vocab_size": llama.runner.vocab_size, "params": sum(p.numel() for p in llama.model.parameters()),
           "vocabulary_s": vocabulary_s, "compile_ms": statistics.median(compile_ms), "batches": {}}
    warm = {}
    for batch in BATCHES:
        engine.keep = batch == max(BATCHES)
        warm[batch] = decode(engine, batch, None, max_new)
        engine.keep = False
        decode(engine, batch, warm[batch].lengths, max_new)
        print(f"{vocab} batch {batch}: answers of {warm[batch].lengths} tokens, {warm[batch].reasons}",
              file=sys.stderr)
    kept = [m.bitmask for m in warm[max(BATCHES)].masks if m.bitmask is not None and m.bitmask.shape[0] == max(BATCHES)]
    out["sampling_ms"] = sampling_ms(kept[::max(1, len(kept) // SAMPLED_MASKS)][:SAMPLED_MASKS],
                                     llama.runner.vocab_size) if kept else None
    runs = {b: {"schema": [], "free": []} for b in BATCHES}
    for r in range(rounds):
        for batch in BATCHES:
            for side in (("schema", "free") if r % 2 == 0 else ("free", "schema")):
                lengths = None if side == "schema" else warm[batch].lengths
                runs[batch][side].append(decode(engine, batch, lengths, max_new))
            print(f"{vocab} round {r + 1} batch {batch}: schema {runs[batch]['schema'][-1].tokens_s:.1f}, "
                  f"unconstrained {runs[batch]['free'][-1].tokens_s:.1f} tokens/s", file=sys.stderr)
    for batch in BATCHES:
        schema, free = runs[batch]["schema"], runs[batch]["free"]
        masks = [m for run in schema for m in run.masks]
        out["batches"][batch] = {
            "schema": [run.tokens_s for run in schema], "free": [run.tokens_s for run in free],
            "lengths": warm[batch].lengths,
            "same_answers": all(run.texts == warm[batch].texts for run in schema),
            "same_tokens": all(run.lengths == warm[batch].lengths for run in schema + free),
            "stopped": sum(reason == "stop" for reason in warm[batch].reasons),
            "valid": sum(valid(text) for text in warm[batch].texts), "example": warm[batch].texts[0],
            "schema_step_ms": statistics.median(ms for run in schema for ms in run.step_ms),
            "free_step_ms": statistics.median(ms for run in free for ms in run.step_ms),
            "schema_advance_ms": statistics.median(ms for run in schema for ms in run.advance_ms),
            "free_advance_ms": statistics.median(ms for run in free for ms in run.advance_ms),
            "mask_steps": len(masks), "ready": sum(m.ready for m in masks),
            "mask_ms": [(m.done - m.submitted) * 1e3 for m in masks],
            "wait_ms": [0.0 if m.ready else max(0.0, m.done - m.forward_done) * 1e3 for m in masks]}
    return out


# --- the BENCHMARKS.md subsection ------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(b: dict) -> float:
    return statistics.median(b["schema"]) / statistics.median(b["free"])


def rows(results: dict) -> list[str]:
    lines = []
    for r in results.values():
        label = f"{SHAPE[0]} shape, {r['vocab_size']:,} ids ({r['params'] / 1e6:.0f}M parameters)"
        for batch, b in r["batches"].items():
            rounds = ", ".join(f"{s / f:.2f}" for s, f in zip(b["schema"], b["free"]))
            mask = (f"{statistics.median(b['mask_ms']):.2f} / {percentile(b['mask_ms'], 0.99):.2f}"
                    if b["mask_ms"] else "–")
            ready = f"{100 * b['ready'] / b['mask_steps']:.0f}% of {b['mask_steps']}" if b["mask_steps"] else "–"
            waited = sum(b["wait_ms"]) / max(1, b["mask_steps"])
            same = "yes" if b["same_answers"] and b["same_tokens"] else "**no**"
            lines.append(
                f"| {label} | {batch} | {min(b['lengths'])}–{max(b['lengths'])} ({b['stopped']}/{len(b['lengths'])}, "
                f"{b['valid']}; {same}) | **{statistics.median(b['schema']):.1f}** | "
                f"{statistics.median(b['free']):.1f} | **{ratio(b):.3f}** | {rounds} | "
                f"{b['schema_step_ms']:.1f} / {b['free_step_ms']:.1f} | "
                f"{b['schema_advance_ms']:.2f} / {b['free_advance_ms']:.2f} | {ready} | {mask} | {waited:.2f} |")
    return lines


def subsection(results: dict, rounds: int, max_new: int) -> str:
    lines = [
        "### Decode with a JSON schema against unconstrained (in-process Engine)",
        "",
        f"engine.Engine at TP=1 ({torch.get_num_threads()} threads, steps on the caller's thread, prefix caching "
        f"off) on bench/decode.py's random {SHAPE[0]} shape (fp32, seed 0) with demo/tokenizer.model's vocabulary "
        "and with the 128k one above (whose output projection and masks cost what Llama 3's do). Prompts of "
        f"{PROMPT_LEN} random ids, greedy. *JSON schema*: every row constrained to a schema whose fields are all "
        "bounded (strings of at most 24, 16 and 10 characters, an integer in 0–120, an enum, a boolean, arrays "
        "of exactly 3 strings and 4 integers in 0–100), so that a random model's answer ends by the grammar's "
        "end; *unconstrained*: EOS ignored, each row decoding exactly as many tokens as its constrained answer, "
        "so both decode the same tokens per row and shrink the batch at the same steps. *Tokens per answer*: "
        f"fewest–most (answers that ended by the grammar's end, not at max_gen_len {max_new}; answers that "
        "jsonschema validates; *same*: every constrained run gave the warm-up's answers, every run its token "
        "counts). tokens/s = tokens sampled in the decode steps / their wall time (the prefill step with the "
        f"first tokens not counted); median over {rounds} round(s), each running both sides in turn (which one "
        "first alternates), after a warm-up of each. *Step*: median wall time of a decode step; *sampling*: "
        "of Engine.advance in it (waiting for the mask, adjust_logits with apply_bitmask, the draw, the "
        "matchers). *Mask ready*: the steps whose bitmask (filled on the engine's masks thread while the forward "
        "pass runs) was done when the forward pass returned; *mask*: its wall time, submitted to done (ms, "
        "median / p99); *waited*: what sampling waited for it, ms per step on average.",
        "",
        "| model | batch | tokens per answer (ended, valid; same) | JSON schema (tokens/s) | unconstrained (tokens/s) "
        "| schema / unconstrained | each round | step, schema / unconstrained (ms) | sampling, schema / "
        "unconstrained (ms) | mask ready | mask (ms) | waited (ms/step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ] + rows(results) + [""]
    sampled = [f"{s['dense']:.1f} ms as they are and {s['masked']:.1f} ms masked with {r['vocab_size']:,} ids"
               for r in results.values() for s in [r["sampling_ms"]] if s]
    if sampled:
        lines.append(
            f"- Why greedy: at temperature 1 (top_p 1), sampler.sample on {max(BATCHES)} rows of random logits took "
            + "; ".join(sampled) + " (masked: by the engine's bitmasks of the warm-up's constrained steps; median). "
            "It sorts each row's whole distribution, and a masked row's is mostly zeros, which sort faster: an A/B "
            "at temperature 1 would count that as the constraint's gain.")
    vocab, first = next(iter(results.items()))
    example = first["batches"][BATCHES[0]]["example"]
    fence = "````" if "```" in example else "```"
    lines += ["", f"The first row's answer at batch {BATCHES[0]} ({vocab} vocabulary, greedy):", "", fence,
              example, fence, ""]
    return "\n".join(lines) + "\n"


def verdicts(results: dict) -> list[str]:
    """The batch-8 target, one line per vocabulary."""
    out = []
    for r in results.values():
        b = r["batches"][max(BATCHES)]
        met = ratio(b) >= TARGET
        out.append(f"{r['vocab_size']:,} ids: {ratio(b):.3f}× ({statistics.median(b['schema']):.1f} against "
                   f"{statistics.median(b['free']):.1f} tokens/s; {'met' if met else '**missed**'})")
    return out
