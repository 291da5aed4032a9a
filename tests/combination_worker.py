"""One combination of the settings that change how a worker computes, loaded as a worker
loads it (loading.load, TP=1), answering greedy chats (test_combinations.py).

    combination_worker.py CHECKPOINT QUANT ATTENTION COMPILE

Prints a JSON line: {"tokens": [each answer's tokens], "flex_steps": the steps that attended
with FlexAttention}.
"""

import json
import sys

import chat_format
import loading
from flex_attention import FlexAttention
from sequence import SamplingParams
from serving_config import ServingConfig

# four long prompts first, prefilled in one step (no limit on a step's tokens) and decoded
# together: their steps gather over 2,048 cached tokens, where handler.attention auto would switch
# to FlexAttention for a model without grouped-query heads; then issue 34's greedy chat questions
# (test_smollm2.py)
PASSAGE = "The lighthouse keeper climbed the stairs every evening and lit the great lamp. "
QUESTIONS = [f"Read this, then give its {what}: {PASSAGE * 36}" for what in ("summary", "title", "moral", "mood")] + [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence.",
    "What is 12 times 12?"]
NEW_TOKENS = 24
SLOTS = 4


def main():
    checkpoint, quant, attention, compiled = sys.argv[1:5]
    config = ServingConfig(checkpoint=checkpoint, quantization=quant, attention=attention,
                           compile=compiled == "true", max_seq_len=1024, max_batched_tokens=0)
    engine, _ = loading.load(config, "", SLOTS, 1, lambda *args, **kwargs: None)
    flex_steps = []
    build = FlexAttention.build.__func__
    FlexAttention.build = classmethod(lambda cls, *args: flex_steps.append(1) or build(cls, *args))
    seqs = [engine.add(chat_format.encode_dialog(engine.tokenizer, [{"role": "user", "content": q}]),
                       SamplingParams(max_gen_len=NEW_TOKENS, temperature=0))
            for q in QUESTIONS]
    while engine.running:
        engine.step()
    print(json.dumps({"tokens": [s.tokens for s in seqs], "flex_steps": len(flex_steps)}))


if __name__ == "__main__":
    main()
