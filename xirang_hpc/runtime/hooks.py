"""What the training loop offers to the layers above it: the hook interface and the event sink.

Checkpointing, monitoring, serving (``model.init_from``) and the job's composition root import
this module (not the trainer) to plug into the loop; the runtime itself never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the trainer imports this module; the annotation only names it
    from xirang_hpc.runtime.trainer import Trainer


class TrainerHook:
    """Extension point for checkpointing, signal handling and monitoring.

    Hooks run on every rank, in registration order. ``on_fit_start`` may restore state
    (``trainer.state``, model, optimizer) before the first step; a hook may set
    ``trainer.stop_requested`` to end the loop cleanly at the next step boundary.
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the initial evaluation and the first step."""

    def on_phase(self, trainer: Trainer, phase: str) -> None:
        """Entering a phase: data | forward | backward | comm | optimizer | eval | checkpoint."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After an optimizer step; ``trainer.state.step`` counts completed steps."""

    def on_log(self, trainer: Trainer, row: dict[str, object]) -> None:
        """Rank 0 only: a metrics row (training or ``val_loss``) before it is appended to metrics.jsonl.

        A hook may add fields to ``row`` (they are written too) and forward it to other loggers.
        """

    def on_fit_end(self, trainer: Trainer, summary: dict[str, object]) -> None:
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


class NullEventSink:
    """An event sink that records nothing (unit tests, tools that run the loop without a run log)."""

    def append(self, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Drop the event; return it as a row."""
        return {"kind": kind, "reason": reason, **fields}

    def count(self, kind: str) -> int:
        """Nothing was recorded."""
        return 0
