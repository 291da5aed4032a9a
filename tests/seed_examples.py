"""The usage examples of the seed documents (shared/seeds: 000, the model; 002, generation),
as written there, with small shapes: the imports name our modules instead of
examples.large_models.tp_llama, the sizes are a test's, and each example returns what it
printed. test_seeds.py runs them in-process (TP=1) and seeds_worker.py on torchrun's ranks."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def seed000_example1(vocab_size: int) -> int:
    """Example 1: creating a model (a Llama-2-7B in the seed)."""
    from llama2 import ModelArgs, Transformer

    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=vocab_size,
        max_seq_len=64,
        max_batch_size=4,
    )

    model = Transformer(args)
    return sum(p.numel() for p in model.parameters())


def seed000_example2(checkpoint_path: str, tokenizer_path: str, vocab_size: int, world_size: int):
    """Example 2: a tensor-parallel model (Llama-2-70B over 8 GPUs in the seed)."""
    from llama2 import ModelArgs, tp_llama

    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=vocab_size,
        max_seq_len=64,
    )

    llama = tp_llama(
        model_args=args,
        checkpoint_path=checkpoint_path,
        tokenizer_path=tokenizer_path,
        world_size=world_size,
    )
    return llama


def seed000_example3(vocab_size: int, tokens: torch.Tensor) -> tuple:
    """Example 3: the forward pass. The seed draws tokens with torch.randint; the test gives
    them, so that every rank and the reference see the same ones. Returns the model too."""
    from llama2 import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=vocab_size, max_batch_size=2, max_seq_len=32)
    model = Transformer(args).to(DEVICE)

    # Input: batch of 2 sequences, each 10 tokens
    tokens = tokens.to(DEVICE)

    # Forward pass at position 0 (first generation step)
    logits = model(tokens, start_pos=0)
    # logits shape: (2, 10, vocab_size)

    # Next token prediction: take logits at the last position
    next_token_logits = logits[:, -1, :]  # shape: (2, vocab_size)
    next_tokens = torch.argmax(next_token_logits, dim=-1)  # shape: (2,)
    return model, logits, next_tokens


def seed002_example1(llama_model, tokenizer) -> list[dict]:
    """Example 1: text completion."""
    from generate import text_completion

    prompts = [
        "The theory of relativity states that",
        "In machine learning, a transformer is",
    ]

    results = text_completion(
        model=llama_model,
        tokenizer=tokenizer,
        prompts=prompts,
        max_gen_len=128,
        temperature=0.6,
        top_p=0.9,
    )
    return results


def seed002_example2(llama_model, tokenizer) -> list[dict]:
    """Example 2: multi-turn chat completion."""
    from generate import Dialog, chat_completion

    dialogs: list[Dialog] = [
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is TorchServe?"},
        ],
        [
            {"role": "system", "content": "You are a coding expert."},
            {"role": "user", "content": "How do I serve a model with TorchServe?"},
            {"role": "assistant", "content": "You can use the torch-model-archiver..."},
            {"role": "user", "content": "Can you show me the config file?"},
        ],
    ]

    results = chat_completion(
        model=llama_model,
        tokenizer=tokenizer,
        dialogs=dialogs,
        max_gen_len=256,
        temperature=0.6,
        top_p=0.9,
    )
    return results


def seed002_example3() -> int:
    """Example 3: nucleus sampling."""
    from generate import sample_top_p

    # Example probability distribution over a vocabulary of 5 tokens
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])

    sampled = sample_top_p(probs, p=0.9)
    return sampled.item()
