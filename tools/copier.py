"""A Llama checkpoint (Meta layout, fp32) of a given shape whose weights make it continue a
passage it has seen: a hand-set induction circuit, for benches of speculative decoding where
no trained model that quotes its prompt is at hand.

    python tools/copier.py --out /tmp/copier [--dim 768 --layers 12 --heads 12]

The residual stream carries a random code per token and a constant. Layer 0 has two heads
whose queries and keys see only the constant, rotated so that rotary embeddings make them
attend to the token 1 and 2 positions back: they write those tokens' codes. In layer 1 every
head looks for the earlier position whose two previous tokens are the current and the
previous token (random projections of the codes, in the head's dimensions that rotary
embeddings barely turn: rope_theta is raised for that) and copies the token there; the
output layer reads the copied codes. Every other weight that would write to the residual
stream is zero, so a step costs what the shape's dense matmuls cost."""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import meta_ffn_hidden_dim  # noqa: E402

CODE = 64  # width of a token's code
ROPE_THETA = 1e12  # pairs from FIXED_PAIR on turn < 0.1 rad over 512 positions
POSITION_PAIRS = 5  # the fast-turning pairs the previous-token heads attend with
FIXED_PAIR = 10
MATCH_NATS = 30.0  # attention logit per unit of code similarity in the copying heads
MATCH_WEIGHTS = (1.0, 0.6, 0.35)  # of the current token, the one before, the one before that
UNMATCHED = 0.5  # a match below this (one on the previous token alone is 0.6) reads BOS, whose code is zero
NEXT = 0.5  # weight of the fallback: a fixed random successor of the current token
POSITION_NATS = 60.0  # attention logit gap between the wanted offset and its neighbours


class Slots:
    """Where the residual stream keeps what: codes of the token, of the one copied, of the
    fallback successor and of the tokens 1, 2, ... back; a constant; BOS's mark."""

    def __init__(self):
        self.tok, self.copied, self.after, *self.back = (slice(i * CODE, (i + 1) * CODE)
                                                         for i in range(3 + len(MATCH_WEIGHTS)))
        self.bias = (3 + len(MATCH_WEIGHTS)) * CODE
        self.sink = self.bias + 1


def copier_weights(dim: int, n_layers: int, n_heads: int, vocab_size: int, bos_id: int, multiple_of: int = 32,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    head_dim, at = dim // n_heads, Slots()
    assert n_layers >= 2 and head_dim >= 2 * FIXED_PAIR + 8 and dim > at.sink and n_heads >= len(MATCH_WEIGHTS)
    g = torch.Generator().manual_seed(seed)
    code = torch.nn.functional.normalize(torch.randn(vocab_size, CODE, generator=g), dim=-1)
    code[bos_id] = 0
    hidden = meta_ffn_hidden_dim(4 * dim, multiple_of, None)
    w = {"tok_embeddings.weight": torch.zeros(vocab_size, dim), "norm.weight": torch.ones(dim),
         "output.weight": torch.zeros(vocab_size, dim)}
    w["tok_embeddings.weight"][:, at.tok] = code
    w["tok_embeddings.weight"][:, at.after] = NEXT * code[torch.randperm(vocab_size, generator=g)]
    w["tok_embeddings.weight"][:, at.bias] = 1.0
    w["tok_embeddings.weight"][bos_id, at.sink] = 1.0
    for i in range(n_layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv"):  # weights whose values do not matter stay random (their cost is real)
            w[p + f"attention.{name}.weight"] = torch.randn(dim, dim, generator=g) * 0.02
        w[p + "attention.wo.weight"] = torch.zeros(dim, dim)
        w[p + "feed_forward.w1.weight"] = torch.randn(hidden, dim, generator=g) * 0.02
        w[p + "feed_forward.w3.weight"] = torch.randn(hidden, dim, generator=g) * 0.02
        w[p + "feed_forward.w2.weight"] = torch.zeros(dim, hidden)
        w[p + "attention_norm.weight"] = torch.ones(dim)
        w[p + "ffn_norm.weight"] = torch.ones(dim)
    attend_back(w, at, dim, head_dim)
    copy_matches(w, at, dim, n_heads, g)
    w["output.weight"][:, at.copied] = code
    w["output.weight"][:, at.after] = code
    return w


def attend_back(w: dict, at: Slots, dim: int, head_dim: int):
    """Layer 0: head h attends h + 1 positions back and writes that token's code into at.back[h]."""
    theta = ROPE_THETA ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    scale = math.sqrt(dim / (2 + NEXT ** 2))  # what RMSNorm multiplies layer 0's input by
    gap = float((1 - torch.cos(theta[:POSITION_PAIRS])).sum())
    size = math.sqrt(POSITION_NATS * math.sqrt(head_dim) / gap)
    p = "layers.0.attention."
    for h, out in enumerate(at.back):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        for name in ("wq", "wk", "wv"):
            w[p + f"{name}.weight"][rows] = 0
        for i in range(POSITION_PAIRS):
            row = h * head_dim + 2 * i
            # q = size * e^(-i theta (h + 1)), k = size: after rotary, score ~ cos(theta (m - n - h - 1))
            w[p + "wq.weight"][row, at.bias] = size * math.cos(theta[i] * (h + 1)) / scale
            w[p + "wq.weight"][row + 1, at.bias] = -size * math.sin(theta[i] * (h + 1)) / scale
            w[p + "wk.weight"][row, at.bias] = size / scale
        w[p + "wv.weight"][h * head_dim:h * head_dim + CODE, at.tok] = torch.eye(CODE) / scale
        w[p + "wo.weight"][out, h * head_dim:h * head_dim + CODE] = torch.eye(CODE)


def copy_matches(w: dict, at: Slots, dim: int, n_heads: int, g: torch.Generator):
    """Layer 1: every head matches the latest tokens against each position's previous ones
    (the nearer, the more weight) and copies the token there; BOS wins where nothing matches."""
    head_dim = dim // n_heads
    scale = math.sqrt(dim / (2 + NEXT ** 2 + len(MATCH_WEIGHTS)))  # and the codes layer 0 wrote
    bos_scale = math.sqrt(dim / 2)  # BOS: constant and mark
    fixed = head_dim - 2 * FIXED_PAIR - 1  # the last dimension: BOS's, apart from the codes'
    size = math.sqrt(MATCH_NATS * math.sqrt(head_dim))
    p = "layers.1.attention."
    for h in range(n_heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        match = slice(h * head_dim + 2 * FIXED_PAIR, (h + 1) * head_dim - 1)
        unmatched = (h + 1) * head_dim - 1
        for name in ("wq", "wk", "wv"):
            w[p + f"{name}.weight"][rows] = 0
        for weight, q, k in zip(MATCH_WEIGHTS, [at.tok] + at.back[:-1], at.back):
            r = torch.randn(fixed, CODE, generator=g) / math.sqrt(fixed)
            w[p + "wq.weight"][match, q] += size * weight * r / scale
            w[p + "wk.weight"][match, k] += size * r / scale
        w[p + "wq.weight"][unmatched, at.bias] = size * UNMATCHED / scale
        w[p + "wk.weight"][unmatched, at.sink] = size / bos_scale
        w[p + "wv.weight"][h * head_dim:h * head_dim + CODE, at.tok] = torch.eye(CODE) / scale
        w[p + "wo.weight"][at.copied, h * head_dim:h * head_dim + CODE] = torch.eye(CODE) / n_heads


def write(out: str, dim: int, n_layers: int, n_heads: int, vocab_size: int, bos_id: int, seed: int = 0) -> str:
    os.makedirs(out, exist_ok=True)
    torch.save(copier_weights(dim, n_layers, n_heads, vocab_size, bos_id, seed=seed),
               os.path.join(out, "consolidated.00.pth"))
    params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_heads,
              "vocab_size": vocab_size, "multiple_of": 32, "norm_eps": 1e-5, "rope_theta": ROPE_THETA}
    with open(os.path.join(out, "params.json"), "w") as f:
        json.dump(params, f)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--bos-id", type=int, default=1)
    a = ap.parse_args()
    write(a.out, a.dim, a.layers, a.heads, a.vocab_size, a.bos_id)


if __name__ == "__main__":
    main()
