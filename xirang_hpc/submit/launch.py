"""The preamble every submitting command shares: one function, one order, nothing written.

``xirang-train``, ``xirang-sbatch`` and ``xirang-pipeline`` each start a run from a Hydra config;
:func:`prepare_launch` is what they do before they write or submit anything, so a check added here
holds for all three, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.files import private_by_default
from xirang_hpc.submit.autoplan import plan_at_launch
from xirang_hpc.submit.preflight import RunStatus, preflight


@dataclass(frozen=True)
class Launch:
    """A launch that passed every check made before anything is written: its typed config and its run."""

    cfg: XirangConfig
    status: RunStatus


def prepare_launch(dcfg: DictConfig, *, auto_plan: bool = False, report_complete: bool = False) -> Launch:
    """The typed config (the Hugging Face step included); the user's files private from here on (or shared
    with ``train.share_group``); the run's identity, completion and paths checked (:func:`preflight`); with
    ``auto_plan`` the layout of ``parallel=auto`` planned (``plan.json``); the layout checked runnable here.

    ``report_complete``: a complete run has nothing left to plan or check, and is returned as it is for the
    command to say so (``xirang-train``). Raises :class:`ConfigError` (a ``PreflightError`` is one) naming the
    field; nothing is written before it returns, ``plan.json`` of ``auto_plan`` aside.
    """
    cfg = load_config(dcfg)
    private_by_default(cfg.train.share_group)  # before anything is created
    status = preflight(cfg)
    if status.complete and report_complete:
        return Launch(cfg, status)
    if auto_plan:
        cfg = plan_at_launch(cfg)  # parallel=auto: the planner fills in the layout, writes plan.json
    check_runnable(cfg)
    return Launch(cfg, status)
