"""One combination of the settings that change how a worker computes, loaded as a worker
loads it (loading.load, TP=1), answering greedy chats (test_combinations.py).

    combination_worker.py CHECKPOINT QUANT ATTENTION COMPILE

Prints a JSON line: {"tokens": [each answer's tokens]}.
"""

import json
import sys

import chat_format
import loading
from sequence import SamplingParams
from serving_config import ServingConfig

# issue 34's greedy chat questions (test_smollm2.py), and a longer one: its chunked prefill and
# a decode past 256 cached tokens, where handler.attention auto switches to FlexAttention
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence.",
             "What is 12 times 12?", "Summarize: " + "The lighthouse keeper climbed the stairs every evening. " * 20]
NEW_TOKENS = 24
SLOTS = 4


def main():
    checkpoint, quant, attention, compiled = sys.argv[1:5]
    config = ServingConfig(checkpoint=checkpoint, quantization=quant, attention=attention,
                           compile=compiled == "true", max_seq_len=512)
    engine, _ = loading.load(config, "", SLOTS, 1, lambda *args, **kwargs: None)
    seqs = [engine.add(chat_format.encode_dialog(engine.tokenizer, [{"role": "user", "content": q}]),
                       SamplingParams(max_gen_len=NEW_TOKENS, temperature=0)) for q in QUESTIONS]
    while engine.running:
        engine.step()
    print(json.dumps({"tokens": [s.tokens for s in seqs]}))


if __name__ == "__main__":
    main()
