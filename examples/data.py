"""A character-level language-modelling corpus that every Python install has: the text of Python's own
documentation topics (``pydoc_data.topics``). Nothing is downloaded."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def load_corpus(max_chars: int | None = None) -> str:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text[:max_chars] if max_chars else text


class CharDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` characters: input is the first ``block_size``, target the next."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(L.LightningDataModule):
    """Characters of the corpus as token ids; the vocabulary is padded to a multiple of 64 (cheap, and divisible by
    any tensor-parallel size up to 64, so the vocab-parallel embedding splits evenly)."""

    def __init__(
        self, block_size: int = 64, batch_size: int = 8, max_chars: int | None = 200_000, val_fraction: float = 0.1
    ) -> None:
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        text = load_corpus(max_chars)
        self.chars = sorted(set(text))
        self.vocab_size = -(-len(self.chars) // 64) * 64
        index = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([index[c] for c in text], dtype=torch.long)
        split = int(len(data) * (1 - val_fraction))
        self.train_set = CharDataset(data[:split], block_size)
        self.val_set = CharDataset(data[split:], block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)
