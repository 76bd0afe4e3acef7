"""Tensors for kernel tests: huge address ranges that cost memory only where written."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def sparse_zeros(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros mapped from a sparse file: any size, yet only the pages written take memory.

    Past 2**31 elements an int32 offset wraps; this reaches such offsets on any machine,
    without the memory (or the overcommit) an allocation that size would need.
    """
    numel = math.prod(shape)
    with open(path, "wb") as f:
        f.truncate(numel * torch.empty(0, dtype=dtype).element_size())
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
    path.unlink()  # the mapping lives on; the file's blocks go with it
    return tensor
