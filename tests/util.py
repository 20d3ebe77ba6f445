"""Small helpers shared by tests."""

from __future__ import annotations

import torch


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
