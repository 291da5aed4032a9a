"""The reader interface that every checkpoint layout implements (checkpoint.py: Meta's and
Hugging Face's folders; gguf_checkpoint.py: GGUF files): a weight plan (tp.weight_plan)
names, for each parameter of a rank's model, the slices of checkpoint tensors (Pieces, by
Meta's names and in Meta's layout) that fill it, and Checkpoint.load_into reads each slice
straight into its rows of the parameter."""

from dataclasses import dataclass

import torch

from weight_files import CheckpointError


@dataclass(frozen=True)
class Piece:
    """The slice [start, end) along dim (None: the whole tensor) of checkpoint tensor
    `name` (Meta's names), whose full shape must be `shape`."""
    name: str
    shape: tuple
    dim: int | None = None
    start: int = 0
    end: int = 0

    @property
    def rows(self) -> int:
        """The slice's size along dim 0: the rows it fills in a parameter."""
        return self.end - self.start if self.dim == 0 else self.shape[0]


class Checkpoint:
    model_args: dict  # ModelArgs keyword arguments

    def tensor(self, piece: Piece) -> torch.Tensor:
        """piece's slice of the checkpoint, in Meta's layout (a view into the file where it can be)."""
        raise NotImplementedError

    def read_into(self, piece: Piece, out: torch.Tensor) -> int:
        """Copy piece's slice into out (of its shape); returns the bytes read."""
        t = self.tensor(piece)
        out.copy_(t)
        return t.nbytes

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module, plan: dict[str, list[Piece]], progress=None) -> int:
        """Fill every parameter of model from the slices that plan names for it, stacked
        along dim 0, each read into its own rows (no temporary of the whole parameter).
        Returns the bytes read; progress, if given, is called with the bytes read so far
        after each parameter."""
        params = dict(model.named_parameters())
        if set(params) != set(plan):
            raise CheckpointError(f"weight plan and model disagree on {sorted(set(params) ^ set(plan))}")
        read = 0
        for name, pieces in plan.items():
            param, row = params[name], 0
            for piece in pieces:
                read += self.read_into(piece, param.narrow(0, row, piece.rows))
                row += piece.rows
            if row != param.shape[0]:
                raise CheckpointError(f"weight plan fills {row} rows of {name}, which has {param.shape[0]}")
            if progress:
                progress(read)
        return read


def narrow(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.end - piece.start)


def check_shape(piece: Piece, shape, where: str):
    if tuple(shape) != tuple(piece.shape):
        raise CheckpointError(f"tensor {piece.name} in {where} has shape {tuple(shape)}, "
                              f"the model needs {tuple(piece.shape)}")
