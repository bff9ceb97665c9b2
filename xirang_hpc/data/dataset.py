"""Windows of ``seq_len + 1`` tokens from HDF5 shards, sampled as a pure function of the step.

Sample ``j`` of step ``s``'s *global* batch is drawn from a generator seeded by
``(seed, split, s)``; data-parallel rank ``r`` of ``dp`` takes the contiguous slice
``[r*B/dp, (r+1)*B/dp)``. Hence:

- the data position is just the step: a resumed run reads exactly the batches the
  uninterrupted run would have read, nothing repeated or skipped;
- every parallel layout sees the same global batch, so a dp=4 run and a single-process run
  compute the same loss (what the layout-equality tests compare).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

from xirang_hpc.data.prepare import CorpusError, load_index

_SPLIT_TAG = {"train": 0, "val": 1}
# Shards up to this many tokens are read into memory once; larger ones are sliced from disk.
_IN_MEMORY_TOKENS = 256 * 1024 * 1024


class TokenWindows:
    """Random-access windows over one split's shards."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        self.seq_len = seq_len
        index = load_index(self.data_dir)
        shards = index["splits"][split]  # type: ignore[index]
        self._tokens: list[np.ndarray | h5py.Dataset] = []
        self._files: list[h5py.File] = []
        starts = []
        for s in shards:
            n = int(s["n_tokens"])
            if n <= seq_len + 1:
                continue  # too short for one window
            f = h5py.File(self.data_dir / s["file"], "r", locking=False)
            ds = f["tokens"]
            if n <= _IN_MEMORY_TOKENS:
                self._tokens.append(ds[:])
                f.close()
            else:
                self._tokens.append(ds)
                self._files.append(f)
            starts.append(n - seq_len)  # number of valid window starts in this shard
        if not starts:
            raise CorpusError(
                f"{split} split in {self.data_dir} has no shard longer than seq_len+1={seq_len + 1} "
                "tokens; use a bigger corpus or a smaller model.seq_len"
            )
        self._cum = np.cumsum([0, *starts])  # cumulative valid starts per shard

    @property
    def num_windows(self) -> int:
        """Number of distinct window positions."""
        return int(self._cum[-1])

    def window(self, pos: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens at global window position ``pos``."""
        shard = int(np.searchsorted(self._cum, pos, side="right") - 1)
        off = pos - int(self._cum[shard])
        return np.asarray(self._tokens[shard][off : off + self.seq_len + 1])

    def positions(self, seed: int, step: int, global_batch: int) -> np.ndarray:
        """Window positions of step ``step``'s global batch: a pure function of its arguments."""
        rng = np.random.default_rng([seed, _SPLIT_TAG[self.split], step])
        return rng.integers(0, self.num_windows, size=global_batch)

    def batch(
        self, seed: int, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's slice of the global batch as (inputs, targets), each (B/dp, T) int64."""
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        per = global_batch // dp_size
        pos = self.positions(seed, step, global_batch)[dp_rank * per : (dp_rank + 1) * per]
        w = torch.from_numpy(np.stack([self.window(int(p)) for p in pos]).astype(np.int64))  # (B, T+1)
        return w[:, :-1], w[:, 1:]

    def close(self) -> None:
        """Close shards read from disk."""
        for f in self._files:
            f.close()
        self._files.clear()
