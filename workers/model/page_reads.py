"""How the chunks cuDNN read from the paged cache were paged (no torch: the engine's tally
reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["PageReads"]


class _Bucket(Protocol):
    @property
    def page_blocks(self) -> int: ...


@dataclass(slots=True)
class PageReads:
    """Chunks cuDNN has read from the pages since start, and of those the ones over pages of
    several blocks (their blocks lay in runs, `cudnn_pages.blocks_per_page`)."""

    num_chunks: int = 0
    num_run_chunks: int = 0

    def count(self, bucket: _Bucket) -> None:
        """One chunk read in this bucket (`cudnn_pages.PagesBucket`)."""
        self.num_chunks += 1
        self.num_run_chunks += bucket.page_blocks > 1
