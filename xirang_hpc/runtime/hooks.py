"""What the training loop offers to the layers above it: the hook interface and the event sink.

Checkpointing, monitoring, serving (``model.init_from``) and the job's composition root import
this module (not the trainer) to plug into the loop; the runtime itself never imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: hooks.py stays importable without building anything
    import torch
    from torch import nn

    from xirang_hpc.config.schema import XirangConfig
    from xirang_hpc.runtime.parallel_dims import Layout
    from xirang_hpc.runtime.topology import Topology


@runtime_checkable
class LoopState(Protocol):
    """What the loop carries between steps (``runtime.trainer.RunState``)."""

    step: int  # completed optimizer steps
    tokens_seen: int
    initial_val_loss: float


@runtime_checkable
class Loop(Protocol):
    """The training loop as a hook sees it: everything a hook may read, and the two things it may do.

    Hooks are written against this, never against ``runtime.trainer.Trainer`` (the import contract forbids
    checkpoint/, monitor/ and serve/ to import it): the loop can change inside without breaking them.
    """

    cfg: XirangConfig
    topo: Topology  # this rank, the world, the nodes
    layout: Layout  # the one validated layout (degrees and placement)
    state: LoopState
    model: nn.Module  # this rank's (stage of the) model, full-model parameter names
    ddp: nn.Module  # what runs forward (the data-parallel wrapper, or the model)
    opt: torch.optim.Optimizer
    dp_size: int
    run_dir: Path
    metrics_path: Path
    log: Callable[[str], None]  # rank 0's progress lines
    # Per-rank state owned by hooks (name -> object with state_dict()/load_state_dict()), saved and restored
    # with the checkpoint for every rank.
    extra_state: dict[str, Any]
    stop_requested: bool

    def phase(self, phase: str) -> None:
        """Enter ``phase`` (every hook's ``on_phase`` sees it): data | forward | backward | comm | optimizer |
        eval | checkpoint."""
        ...

    def request_stop(self) -> None:
        """End the loop cleanly at the next step boundary."""
        ...


class TrainerHook:
    """Extension point for checkpointing, signal handling and monitoring.

    Hooks run on every rank, in registration order. ``on_fit_start`` may restore state
    (``loop.state``, model, optimizer) before the first step; a hook may call ``loop.request_stop()``
    to end the loop cleanly at the next step boundary.
    """

    def on_build_start(self, trainer: Loop) -> None:
        """After the rendezvous, before the model, its layout and the data are built: only ``cfg``, ``topo``,
        ``run_dir`` and ``state`` (step 0) are set yet. For what must watch the build (the monitor)."""

    def on_fit_start(self, trainer: Loop) -> None:
        """Before the initial evaluation and the first step."""

    def on_phase(self, trainer: Loop, phase: str) -> None:
        """Entering a phase: data | forward | backward | comm | optimizer | eval | checkpoint."""

    def on_step_end(self, trainer: Loop, metrics: dict[str, float]) -> None:
        """After an optimizer step; ``trainer.state.step`` counts completed steps."""

    def on_log(self, trainer: Loop, row: dict[str, object]) -> None:
        """Rank 0 only: a metrics row (training or ``val_loss``) before it is appended to metrics.jsonl.

        A hook may add fields to ``row`` (they are written too) and forward it to other loggers.
        """

    def on_fit_end(self, trainer: Loop, summary: dict[str, object]) -> None:
        """After the final evaluation, before the process group goes away."""


class EventSink(Protocol):
    """Where the runtime records job events (start, stop, requeue, exit) and reads them back.

    The job's composition root passes the run's event log (``monitor.events.EventLog``); the
    runtime only knows this interface.
    """

    def append(self, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Record one event."""
        ...

    def count(self, kind: str) -> int:
        """How many events of ``kind`` were recorded so far."""
        ...

    def rows(self) -> list[dict[str, Any]]:
        """Every event recorded so far, oldest first."""
        ...


class NullEventSink:
    """An event sink that records nothing (unit tests, tools that run the loop without a run log)."""

    def append(self, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Drop the event; return it as a row."""
        return {"kind": kind, "reason": reason, **fields}

    def count(self, kind: str) -> int:
        """Nothing was recorded."""
        return 0

    def rows(self) -> list[dict[str, Any]]:
        """Nothing was recorded."""
        return []
