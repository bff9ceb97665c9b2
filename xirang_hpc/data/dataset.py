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
from xirang_hpc.data.prepare_chat import no_learnable_sample

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


# ---- chat samples (data.format=chat) --------------------------------------------------------------
#: Target id of a position the loss ignores (masked prompt tokens, padding): torch's cross-entropy default.
IGNORE_INDEX = -100
# Rows kept open for first-fit packing; a sample goes into the first open row it fits, else a new row.
_OPEN_ROWS = 64


class ChatSamples:
    """Whole chat samples as rows of ``seq_len`` positions, a pure function of the step like :class:`TokenWindows`.

    A sample of ``L`` tokens fills ``L - 1`` positions (inputs ``ids[:-1]``, targets ``ids[1:]``; a target the
    loss mask does not learn is :data:`IGNORE_INDEX`). ``packing=False``: one sample per row, the rest padding
    (pad inputs 0, targets ignored). ``packing=True``: whole samples packed first-fit into rows, with
    ``position_ids`` restarting at 0 at every sample (and every run of padding), which the model turns into
    per-sample rotary positions and a block-diagonal causal mask. A sample longer than ``seq_len + 1`` tokens
    is cut to its first ``seq_len + 1`` (``overlong=truncate``) or left out (``drop``); both are counted in
    :attr:`summary`. Each epoch is a fresh permutation seeded by ``(seed, split, epoch)``; step ``s`` takes
    rows ``[s*B, (s+1)*B)`` of the endless sequence of epochs, so every layout sees the same global batch.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, packing: bool = False,
                 overlong: str = "truncate", seed: int = 0) -> None:
        self.data_dir, self.split, self.seq_len, self.packing, self.seed = Path(data_dir), split, seq_len, packing, seed
        index = load_index(self.data_dir)
        if index.get("format") != "chat":
            raise CorpusError(f"{self.data_dir} holds text data, not chat samples; prepare it with data.format=chat")
        ids: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        truncated = dropped = unlearnable = 0
        for s in index["splits"][split]:
            with h5py.File(self.data_dir / s["file"], "r", locking=False) as f:
                tokens, mask, offsets = f["tokens"][:], f["loss_mask"][:], f["offsets"][:]
            for a, b in zip(offsets[:-1], offsets[1:]):
                if b - a > seq_len + 1:
                    if overlong == "drop":
                        dropped += 1
                        continue
                    truncated += 1
                    b = a + seq_len + 1
                if b - a < 2 or not mask[a + 1 : b].any():  # nothing left to learn (a cut removed the reply)
                    unlearnable += 1
                    continue
                ids.append(tokens[a:b].astype(np.int64))
                masks.append(mask[a:b].astype(bool))
        if not ids:
            raise no_learnable_sample(self.data_dir, split, seq_len, overlong)
        self._ids, self._masks = ids, masks
        self._slots = np.asarray([len(a) - 1 for a in ids])  # positions each sample fills
        self._epochs: list[list[list[int]]] = []
        self._epoch_start = [0]  # first global row of each planned epoch
        #: What loading did to the samples (logged by the trainer).
        self.summary = {"samples": len(ids), "overlong": overlong, "truncated": truncated, "dropped": dropped,
                        "left_out_nothing_to_learn": unlearnable}

    def _plan(self, epoch: int) -> list[list[int]]:
        """The rows of one epoch: lists of sample indices (one each without packing)."""
        rng = np.random.default_rng([self.seed, _SPLIT_TAG[self.split], epoch])
        order = rng.permutation(len(self._ids))
        if not self.packing:
            return [[int(i)] for i in order]
        rows: list[list[int]] = []
        free: list[int] = []  # room left in each open row
        open_at: list[int] = []  # which row each open slot is
        for i in order:
            need = int(self._slots[i])
            k = next((j for j, room in enumerate(free) if room >= need), -1)
            if k < 0:
                rows.append([])
                free.append(self.seq_len)
                open_at.append(len(rows) - 1)
                k = len(free) - 1
            rows[open_at[k]].append(int(i))
            free[k] -= need
            if free[k] == 0 or len(free) > _OPEN_ROWS:
                drop = k if free[k] == 0 else 0
                del free[drop], open_at[drop]
        return rows

    def _row_samples(self, g: int) -> list[int]:
        """The samples of global row ``g``."""
        while g >= self._epoch_start[-1]:
            plan = self._plan(len(self._epochs))
            self._epochs.append(plan)
            self._epoch_start.append(self._epoch_start[-1] + len(plan))
        e = int(np.searchsorted(self._epoch_start, g, side="right") - 1)
        return self._epochs[e][g - self._epoch_start[e]]

    def row(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, position ids) of global row ``g``, each (seq_len,) int64."""
        t = self.seq_len
        x = np.zeros(t, dtype=np.int64)
        y = np.full(t, IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros(t, dtype=np.int64)
        o = 0
        for i in self._row_samples(g):
            ids, m = self._ids[i], self._masks[i]
            n = len(ids) - 1
            x[o : o + n] = ids[:-1]
            y[o : o + n] = np.where(m[1:], ids[1:], IGNORE_INDEX)
            pos[o : o + n] = np.arange(n)
            o += n
        pos[o:] = np.arange(t - o)  # the padding is one more "sample" of its own, learned from by nobody
        return x, y, pos

    def global_batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``step``'s whole global batch: (inputs, targets, position ids), each (B, T) int64."""
        rows = [self.row(step * global_batch + j) for j in range(global_batch)]
        x, y, pos = (torch.from_numpy(np.stack(a)) for a in zip(*rows))  # (B, T) each
        return x, y, pos

    def batch(self, seed: int, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """This dp rank's slice: (inputs, targets, position ids or None without packing, learned targets in the
        whole global batch). ``seed`` is the one given at construction (kept for :class:`TokenWindows`' signature)."""
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        x, y, pos = self.global_batch(step, global_batch)
        n_learned = int((y != IGNORE_INDEX).sum())
        per = global_batch // dp_size
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        return x[sl], y[sl], (pos[sl] if self.packing else None), n_learned

    def close(self) -> None:
        """Nothing held open (samples are read into memory)."""


def overlong_samples(data_dir: str | Path, seq_len: int) -> dict[str, int]:
    """Per split, how many chat samples are longer than ``seq_len + 1`` tokens (read from the offsets only)."""
    index = load_index(data_dir)
    out = {}
    for split, shards in index["splits"].items():
        n = 0
        for s in shards:
            with h5py.File(Path(data_dir) / s["file"], "r", locking=False) as f:
                n += int((np.diff(f["offsets"][:]) > seq_len + 1).sum())
        out[split] = n
    return out


class PairSamples:
    """Preference pairs (``data.format=pairs``) as rows: a pure function of the step like :class:`ChatSamples`.

    The shards hold each pair as two consecutive samples, chosen then rejected, with masks on the completion
    tokens. A pair either of whose sequences is longer than ``seq_len + 1`` tokens is cut to ``seq_len + 1``
    (``overlong=truncate``; left out when the cut leaves a reply with no token) or left out (``drop``); both
    are counted in :attr:`summary`. Each epoch is a permutation of the pairs seeded by ``(seed, split, epoch)``;
    step ``s`` takes pairs ``[s*B, (s+1)*B)`` of the endless sequence of epochs.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, overlong: str = "truncate",
                 seed: int = 0) -> None:
        self.data_dir, self.split, self.seq_len, self.seed = Path(data_dir), split, seq_len, seed
        index = load_index(self.data_dir)
        if index.get("format") != "pairs":
            raise CorpusError(f"{self.data_dir} holds {index.get('format', 'text')} data, not preference pairs; "
                              "prepare it with data.format=pairs")
        self._pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        truncated = dropped = unlearnable = 0
        for s in index["splits"][split]:
            with h5py.File(self.data_dir / s["file"], "r", locking=False) as f:
                tokens, mask, offsets = f["tokens"][:], f["loss_mask"][:], f["offsets"][:]
            for k in range(0, len(offsets) - 1, 2):
                spans = [(int(offsets[k + j]), int(offsets[k + j + 1])) for j in (0, 1)]
                if any(b - a > seq_len + 1 for a, b in spans):
                    if overlong == "drop":
                        dropped += 1
                        continue
                    truncated += 1
                    spans = [(a, min(b, a + seq_len + 1)) for a, b in spans]
                if any(b - a < 2 or not mask[a + 1 : b].any() for a, b in spans):
                    unlearnable += 1
                    continue
                (ca, cb), (ra, rb) = spans
                self._pairs.append((tokens[ca:cb].astype(np.int64), mask[ca:cb].astype(bool),
                                    tokens[ra:rb].astype(np.int64), mask[ra:rb].astype(bool)))
        if not self._pairs:
            raise CorpusError(f"{split} split in {self.data_dir} has no pair to learn from at seq_len={seq_len} "
                              f"(data.overlong={overlong}: every pair is longer, or loses a reply when cut); use "
                              "a larger model.seq_len")
        self._orders: list[np.ndarray] = []
        #: What loading did to the pairs (logged by the trainer).
        self.summary = {"pairs": len(self._pairs), "overlong": overlong, "truncated": truncated, "dropped": dropped,
                        "left_out_nothing_to_learn": unlearnable}

    def _pair(self, g: int) -> int:
        """The pair index at global position ``g`` of the endless sequence of epochs."""
        n = len(self._pairs)
        epoch = g // n
        while len(self._orders) <= epoch:
            rng = np.random.default_rng([self.seed, _SPLIT_TAG[self.split], len(self._orders)])
            self._orders.append(rng.permutation(n))
        return int(self._orders[epoch][g % n])

    def _row(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = self.seq_len
        x = np.zeros(t, dtype=np.int64)
        y = np.full(t, IGNORE_INDEX, dtype=np.int64)
        n = len(ids) - 1
        x[:n] = ids[:-1]
        y[:n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        return x, y

    def batch(self, seed: int, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's pairs of step ``step`` as (inputs, targets), each (2 * B/dp, T) int64: the chosen rows
        first, then the rejected ones in the same order. ``seed``: the one given at construction."""
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        per = global_batch // dp_size
        picked = [self._pairs[self._pair(step * global_batch + dp_rank * per + j)] for j in range(per)]
        rows = [self._row(p[0], p[1]) for p in picked] + [self._row(p[2], p[3]) for p in picked]
        x, y = (torch.from_numpy(np.stack(a)) for a in zip(*rows))
        return x, y

    def close(self) -> None:
        """Nothing held open (pairs are read into memory)."""
