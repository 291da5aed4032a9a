"""Train the demo model that ships in demo/: a small Llama, and a SentencePiece BPE tokenizer,
both learnt from the public-domain English fortunes of Debian's fortunes and fortunes-min
packages, saved in Meta's layout (params.json, consolidated.00.pth, tokenizer.model).
About 35 minutes on two CPU cores; --steps with --seed reproduces a run exactly.

    apt-get install fortunes fortunes-min
    python tools/train_demo.py --seed 0
"""

import argparse
import io
import math
import os
import random
import re
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # on a busy machine spinning threads run 3-10x slower
import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import chat_format  # noqa: E402
import generate  # noqa: E402
import llama2  # noqa: E402
from make_checkpoint import save_meta  # noqa: E402
from model import meta_ffn_hidden_dim  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

FORTUNES = "/usr/share/games/fortunes"
SKIP = {"ascii-art", "translate-me"}  # pictures, and Latin
WRAPPED = 55  # a line at least this long was hard-wrapped: its paragraph goes on
TOPICS = {"art": "art", "computers": "computers", "debian": "Debian", "drugs": "drugs", "education": "education",
          "food": "food", "humorists": "humor", "kids": "children", "law": "the law", "linux": "Linux",
          "linuxcookie": "Linux", "literature": "literature", "love": "love", "magic": "magic",
          "medicine": "medicine", "men-women": "men and women", "news": "the news", "people": "people",
          "perl": "Perl", "pets": "pets", "politics": "politics", "riddles": "riddles", "science": "science",
          "songs-poems": "poetry", "sports": "sports", "startrek": "Star Trek", "tao": "the Tao",
          "wisdom": "wisdom", "work": "work", "paradoxum": "paradoxes"}
ASK_TOPIC = ["Tell me something about {}.", "What do you know about {}?", "Give me a quote about {}."]
ASK_ANY = ["Tell me a fortune.", "Say something clever.", "Tell me something funny."]
SYSTEM = ["You are a helpful assistant.", "You are a witty fortune teller.", "You are a wise old sage."]
CHAT_FRACTION, SYSTEM_FRACTION = 0.5, 0.25
PROMPTS = ["The meaning of life is", "A man walked into a bar"]
CHAT = [[{"role": "user", "content": "Tell me something about love."}],
        [{"role": "system", "content": "You are a wise old sage."}, {"role": "user", "content": "What is wisdom?"}]]


def read_fortunes(folder: str) -> list[tuple[str, str]]:
    """(file name, text) of every fortune in the English plain-text files of folder. Only its
    files are read: the offensive ones live in the off/ folder, and .dat/.u8 are indexes and links."""
    if not os.path.isdir(folder):
        sys.exit(f"{folder} not found: apt-get install fortunes fortunes-min")
    fortunes = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or "." in name or name in SKIP:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            fortunes += [(name, t) for t in map(clean, re.split(r"^%\n", f.read(), flags=re.M)) if t]
    return fortunes


def clean(text: str) -> str:
    """Undo terminal overstriking (x BACKSPACE y shows y), drop indentation and spacing, and join
    hard-wrapped prose into one line per paragraph; short lines (verse) and indented lines
    (dialogue, attributions) keep their line breaks."""
    n = 1
    while n:
        text, n = re.subn(r"[^\x08]\x08", "", text)
    lines, previous = [], 0
    for raw in text.replace("\x08", "").split("\n"):
        line = " ".join(raw.split())
        if line and lines and lines[-1] and previous >= WRAPPED and raw[0] not in " \t<-*":
            lines[-1] += " " + line
        else:
            lines.append(line)
        previous = len(line)
    return "\n".join(lines).strip()


def train_tokenizer(texts: list[str], vocab_size: int, path: str):
    """BPE in the layout of Meta's Llama tokenizer: unk 0, bos 1, eos 2, no pad, text kept as is,
    characters outside the vocabulary (newline among them) as byte tokens."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=(line for t in texts for line in t.split("\n") if line), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        character_coverage=0.9999, num_threads=2, minloglevel=2)
    with open(path, "wb") as f:
        f.write(model.getvalue())


def dialog(rng: random.Random, name: str, text: str) -> list[dict]:
    """A user turn that asks for the fortune, by topic or by its first sentence (or line), and
    the assistant turn that gives it (or the rest of it); sometimes a system message first."""
    first = re.match(r"(.{15,}?(?:[.!?](?= )|(?=\n)))\s+(\S.*)", text, re.S)  # 15: not after an initial
    if first and not first[2].startswith("--") and rng.random() < 0.5:  # an attribution is no answer
        turns = [{"role": "user", "content": first[1]}, {"role": "assistant", "content": first[2]}]
    else:
        ask = rng.choice(ASK_TOPIC).format(TOPICS[name]) if name in TOPICS else rng.choice(ASK_ANY)
        turns = [{"role": "user", "content": ask}, {"role": "assistant", "content": text}]
    if rng.random() < SYSTEM_FRACTION:
        turns.insert(0, {"role": "system", "content": rng.choice(SYSTEM)})
    return turns


def encode_exchange(tokenizer, turns: list[dict]) -> list[int]:
    """BOS [INST] user [/INST] answer EOS, exactly as encode_dialog lays out a finished exchange:
    it only encodes dialogs that end with a user turn, so add one and cut it off again."""
    tokens = chat_format.encode_dialog(tokenizer, turns + [{"role": "user", "content": "?"}])
    return tokens[:len(tokens) - 1 - tokens[::-1].index(tokenizer.bos_id)]


def epoch_tokens(tokenizer, fortunes: list[tuple[str, str]], rng: random.Random) -> list[int]:
    """The fortunes in a fresh order, each as plain text (BOS text EOS) or as a chat exchange."""
    tokens = []
    for name, text in rng.sample(fortunes, len(fortunes)):
        if rng.random() < CHAT_FRACTION:
            tokens += encode_exchange(tokenizer, dialog(rng, name, text))
        else:
            tokens += tokenizer.encode(text, bos=True, eos=True)
    return tokens


def batches(tokenizer, fortunes, seq_len: int, batch_size: int, seed: int):
    """Endless (batch, seq_len) batches of packed examples, epoch after epoch."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    while True:
        stream = torch.tensor(epoch_tokens(tokenizer, fortunes, rng))
        n = len(stream) // seq_len
        rows = stream[:n * seq_len].view(n, seq_len)[torch.randperm(n, generator=gen)]
        for i in range(0, n - batch_size + 1, batch_size):
            yield rows[i:i + batch_size]


def build_model(a, vocab_size: int):
    """A LlamaForCausalLM whose FFN width follows Meta's rule, so that params.json describes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    meta = {"dim": a.dim, "n_layers": a.layers, "n_heads": a.heads, "n_kv_heads": a.kv_heads,
            "vocab_size": vocab_size, "multiple_of": a.multiple_of, "norm_eps": 1e-5, "rope_theta": 10000.0}
    config = LlamaConfig(hidden_size=a.dim, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, vocab_size=vocab_size,
                         intermediate_size=meta_ffn_hidden_dim(4 * a.dim, a.multiple_of, None),
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=a.seq_len,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(config)
    model.meta_params = meta
    return model


@torch.no_grad()
def evaluate(model, rows: torch.Tensor) -> float:
    model.eval()
    loss = sum(model(input_ids=b, labels=b).loss.item() * len(b) for b in rows.split(16)) / len(rows)
    model.train()
    return loss


def train(model, data, val_rows, a) -> list[tuple[int, float, float]]:
    """AdamW with warmup and a cosine decay to a tenth of the peak rate, in bfloat16 autocast
    (AMX on recent Xeons). The schedule runs over --steps, or over --minutes of wall time.
    Returns (step, mean train loss since the last report, validation loss) per report."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not the norms
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    start, step, progress, losses, curve = time.time(), 0, 0.0, [], []
    model.train()
    while progress < 1:
        lr = a.lr * min(1, (step + 1) / a.warmup) * (0.55 + 0.45 * math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = lr
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        progress = (time.time() - start) / (60 * a.minutes) if a.minutes else step / a.steps
        if step % a.report == 0 or progress >= 1:
            curve.append((step, sum(losses) / len(losses), evaluate(model, val_rows)))
            losses = []
            print(f"step {step:5d}  lr {lr:.2e}  train {curve[-1][1]:.3f}  val {curve[-1][2]:.3f}  "
                  f"{time.time() - start:5.0f}s", flush=True)
    return curve


def check_and_sample(model, folder: str, val_rows: torch.Tensor):
    """Load the saved folder the way the server does, check its logits against the trained
    model's, and print completions and chat answers."""
    llama = llama2.tp_llama(None, folder, os.path.join(folder, "tokenizer.model"), 1)
    tokens = val_rows[:1, :64]
    with torch.no_grad():
        want = model.eval()(input_ids=tokens).logits
    got = llama.runner(tokens, 0)
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"saved model vs trained model: max logit difference {err:.1e} of the largest logit")
    assert err < 1e-3, "the saved checkpoint does not reproduce the trained model"
    for prompt, out in zip(PROMPTS, generate.text_completion(llama.runner, llama.tokenizer, PROMPTS, max_gen_len=40,
                                                              temperature=0.7, top_p=0.9, seed=1)):
        print(f"\n> {prompt}\n{out['generation']}")
    for turns, out in zip(CHAT, generate.chat_completion(llama.runner, llama.tokenizer, CHAT, max_gen_len=60,
                                                          temperature=0.7, top_p=0.9, seed=1)):
        print(f"\n[user] {turns[-1]['content']}\n[assistant] {out['generation']['content']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "demo"))
    ap.add_argument("--fortunes", default=FORTUNES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1600)  # about where held-out loss stops falling
    ap.add_argument("--minutes", type=float, default=None, help="train for this long instead of --steps")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--multiple-of", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512)  # the server's max_seq_len: RoPE positions must be trained
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--report", type=int, default=200, help="steps between loss reports")
    a = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(a.out, exist_ok=True)

    fortunes = read_fortunes(a.fortunes)
    random.Random(a.seed).shuffle(fortunes)
    n_val = len(fortunes) // 50  # held out, to see when the model stops generalising
    val, fortunes = fortunes[:n_val], fortunes[n_val:]
    tokenizer_path = os.path.join(a.out, "tokenizer.model")
    train_tokenizer([t for _, t in fortunes], a.vocab, tokenizer_path)
    tokenizer = Tokenizer(tokenizer_path)
    val_stream = torch.tensor([i for _, t in val for i in tokenizer.encode(t, bos=True, eos=True)])
    val_rows = val_stream[:len(val_stream) // a.seq_len * a.seq_len].view(-1, a.seq_len)
    print(f"{len(fortunes)} fortunes for training, {len(val)} held out ({val_stream.numel()} tokens)")

    model = build_model(a, tokenizer.n_words)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, FFN width "
          f"{model.config.intermediate_size}")
    start = time.time()
    curve = train(model, batches(tokenizer, fortunes, a.seq_len, a.batch_size, a.seed), val_rows, a)
    minutes = (time.time() - start) / 60
    with torch.no_grad():  # ship bfloat16: the model checked below is the one in the files
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    save_meta(model, a.out, mp=1, dtype=torch.bfloat16)
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out)) / 2**20

    print(f"\ntrained {curve[-1][0]} steps in {minutes:.1f} minutes; wrote {a.out} ({size:.1f} MiB)")
    print("loss curve (step: train / held-out):")
    for step, train_loss, val_loss in curve[::-max(1, len(curve) // 10)][::-1]:  # about 10, the last among them
        print(f"  {step:5d}: {train_loss:.3f} / {val_loss:.3f}")
    print(f"  final held-out loss in bfloat16: {evaluate(model, val_rows):.3f}")
    check_and_sample(model, a.out, val_rows)


if __name__ == "__main__":
    main()
