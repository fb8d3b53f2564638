"""Byte-level text from the Python standard library's own source files: a corpus every machine has.

Nothing is downloaded or shipped. The selection is deterministic (sorted relative paths of ``*.py`` under
``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages`` and test suites) and capped, so every replica group
of a job on the same Python build reads the same bytes. Groups on different Python builds would read different
text; the data module therefore logs the corpus digest for comparison.
"""

from __future__ import annotations

import hashlib
import logging
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_fthsdp.models.held_out import held_out

log = logging.getLogger("fthsdp.data")
_SKIPPED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_corpus(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the concatenated, sorted ``*.py`` files of the Python standard library.

    Raises ValueError when the folder holds no such text (a Python installed without its sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIPPED_PARTS.intersection(p.relative_to(root).parts))
    chunks, size = [], 0
    for path in files:
        if size >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise ValueError(f"no *.py source text under {root}: the LM recipes read the standard library's sources; "
                         "install a Python that ships them (most do) or use model=mlp data=generated")
    return corpus


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``context + 1`` bytes: input = the first ``context``, target = shifted by one."""

    def __init__(self, corpus: bytes, context: int) -> None:
        self._tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        self._context = context
        self._count = (len(corpus) - 1) // context
        if self._count < 1:
            raise ValueError(f"a corpus of {len(corpus)} bytes holds no window of context={context} + 1 bytes")

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self._context
        window = self._tokens[start:start + self._context + 1].long()
        return window[:-1], window[1:]


class StdlibTextData(pl.LightningDataModule):
    """Byte-level windows of the standard library's source text (shuffled by Lightning's sampler); the last
    ``val_windows`` windows of the corpus are held out for validation and never trained on."""

    def __init__(self, context: int = 64, corpus_mb: float = 2.0, batch_size: int = 16, val_windows: int = 256) -> None:
        super().__init__()
        self.context, self.corpus_bytes, self.batch_size = context, int(corpus_mb * 2**20), batch_size
        self.val_windows = val_windows
        self._train: Subset[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._val: Subset[tuple[torch.Tensor, torch.Tensor]] | None = None

    def setup(self, stage: str) -> None:
        corpus = stdlib_corpus(self.corpus_bytes)
        log.info("corpus: %d bytes of stdlib source, sha256 %s", len(corpus), hashlib.sha256(corpus).hexdigest()[:16])
        windows = ByteWindows(corpus, self.context)
        self._train, self._val = held_out(windows, self.val_windows, "val_windows")

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        assert self._train is not None, "Lightning calls setup() before train_dataloader()"
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        assert self._val is not None, "Lightning calls setup() before val_dataloader()"
        return DataLoader(self._val, batch_size=self.batch_size)

