"""The files that hold a checkpoint's weights, read as plain tensors and memory-mapped:
torch.save archives (Meta's consolidated.NN.pth) and .safetensors files (Hugging Face's).
Each is checked before it is mapped: a .pth file is loaded with weights_only (no pickled
code runs) and must keep its zip directory; every safetensors tensor's offsets must lie
within its file and fit its dtype and shape. checkpoint.py reads the layouts made of them."""

import json
import math
import os
import struct
import zipfile

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be served. Defined here, below checkpoint.py, which imports
    it; checkpoint.CheckpointError is its public name (in tracebacks and pickles too)."""
    __module__ = "checkpoint"


def load_pth(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # weights_only refuses pickled code; a torn file fails here too
        raise CheckpointError(f"cannot load {path} as plain tensors: {e}") from e


def check_zip(path: str):
    """torch.save writes a zip archive whose directory is at its end: a file cut short has
    lost it. Reads the directory only."""
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path} is truncated or not a torch.save file ({os.path.getsize(path)} bytes, "
                              f"no zip directory at its end: {e})") from None


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def safetensors_header(path: str) -> tuple[dict, int]:
    """(tensor entries, where the data starts) of a .safetensors file, after checking that
    every tensor's bytes lie within the file and fit its dtype and shape: the tensors are
    views into a memory map, which nothing else bounds."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:  # before reading n bytes: any other file's first 8 bytes make a huge n
            raise CheckpointError(f"{path} is not a safetensors file (its first 8 bytes give a header length "
                                  f"of {n}, the file has {size} bytes)")
        try:
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header: {e!r}") from e
    for name, info in header.items():
        check_tensor_bytes(path, name, info, 8 + n, size)
    return header, 8 + n


def check_tensor_bytes(path: str, name: str, info, data_start: int, size: int):
    """Refuse a header entry whose data_offsets (relative to data_start) leave the file or
    disagree with the byte size of its dtype and shape (for SAFETENSORS_DTYPES, the dtypes
    that can be read)."""
    try:
        begin, end = info["data_offsets"]
        dtype, shape = info["dtype"], list(info["shape"])
        well_formed = isinstance(dtype, str) and all(isinstance(v, int) for v in (begin, end, *shape)) \
            and min(shape, default=0) >= 0
    except (KeyError, TypeError, ValueError):
        well_formed = False
    if not well_formed:
        raise CheckpointError(f"{path}: unreadable safetensors header entry for tensor {name}: {info}")
    if not 0 <= begin <= end:
        raise CheckpointError(f"{path}: tensor {name} has data offsets {[begin, end]}, not 0 <= begin <= end")
    if data_start + end > size:
        raise CheckpointError(f"{path} is truncated or its header corrupt: tensor {name} ends at byte "
                              f"{data_start + end}, the file has {size} bytes")
    if dtype in SAFETENSORS_DTYPES:
        needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != needed:
            raise CheckpointError(f"{path}: tensor {name} has {end - begin} bytes (data offsets {[begin, end]}), "
                                  f"its dtype {dtype} and shape {shape} need {needed}")


class SafetensorsFile:
    """A .safetensors file, memory-mapped; tensors are views into the map."""

    def __init__(self, path: str):
        self.path = path
        self.header, self.data_start = safetensors_header(path)
        self.storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = (self.data_start + o for o in info["data_offsets"])  # checked by safetensors_header
        shape = info["shape"]
        if begin % dtype.itemsize == 0:
            return torch.empty(0, dtype=dtype).set_(self.storage, begin // dtype.itemsize, shape)
        raw = torch.empty(0, dtype=torch.uint8).set_(self.storage, begin, (end - begin,))
        return raw.clone().view(dtype).view(shape)  # unaligned: copy out of the map
