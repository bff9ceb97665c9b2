"""Object collectives on a checkpoint's own process group, shared by the disk and the memory checkpoints."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class GroupCollectives:
    """``_gather`` and ``_barrier`` on ``self.group`` (None: the default group) of ``self.world_size`` ranks;
    both are no-ops in a single process or before the process group exists."""

    world_size: int
    group: Any

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(group=self.group)
