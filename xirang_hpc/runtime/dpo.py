"""The DPO reference model's place in the loop: the starting weights, taken before a checkpoint restore."""

from __future__ import annotations

from xirang_hpc.runtime.hooks import Loop, TrainerHook


class ReferenceHook(TrainerHook):
    """``finetune.method=dpo``: freeze the reference at the model's starting weights.

    Registered after the ``model.init_from`` hook and before the checkpoint hook, so that the reference is the
    imported model (not the seed's initial values) and a resumed run's reference is the same as the first
    start's (the restore moves the policy only). With adapters the reference is the base itself: nothing to copy.
    """

    def on_fit_start(self, trainer: Loop) -> None:
        """Copy the model's current weights into the trainer's frozen reference."""
        refresh = getattr(trainer, "refresh_reference", None)
        if refresh is not None:
            refresh()
