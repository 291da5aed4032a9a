"""SentencePiece tokenizer with the interface of Meta's reference Llama code."""

import os

from sentencepiece import SentencePieceProcessor


class Tokenizer:
    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model not found: {model_path}")
        self.sp_model = SentencePieceProcessor(model_file=model_path)
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        if not isinstance(s, str):
            raise TypeError(f"can only encode str, got {type(s).__name__}")
        t = self.sp_model.encode(s)
        if bos:
            t = [self.bos_id] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def decode(self, t: list[int]) -> str:
        return self.sp_model.decode(list(t))

    def id_to_piece(self, token_id: int) -> str:
        return self.sp_model.id_to_piece(token_id)
