"""Dataclass schemas for every Hydra config group.

Each group (``model/``, ``cluster/``, ...) has one dataclass in a module of this package; the YAML files under
``conf/`` are presets that fill these schemas. Field-local checks live in ``__post_init__``
(they run when OmegaConf turns the composed config into objects); checks that span groups
(tp vs heads, dp*tp*pp vs world size) live in :mod:`xirang_hpc.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from xirang_hpc.config.schema.checkpoint import COMPRESSIONS, CheckpointConfig, RequeueConfig
from xirang_hpc.config.schema.cluster import PRIORITIES, SITE_POLICIES, SITE_SWEEPS, ClusterConfig, SiteConfig
from xirang_hpc.config.schema.comm import CommConfig
from xirang_hpc.config.schema.data import DataConfig
from xirang_hpc.config.schema.finetune import FinetuneConfig, LoraConfig
from xirang_hpc.config.schema.model import ModelConfig
from xirang_hpc.config.schema.monitor import MonitorConfig
from xirang_hpc.config.schema.parallel import ParallelConfig
from xirang_hpc.config.schema.preference import PreferenceConfig
from xirang_hpc.config.schema.serve import EvalConfig, ServeConfig
from xirang_hpc.config.schema.target import TargetConfig
from xirang_hpc.config.schema.train import LOGGERS, TrainConfig

__all__ = [
    "COMPRESSIONS",
    "CheckpointConfig",
    "ClusterConfig",
    "CommConfig",
    "DataConfig",
    "EvalConfig",
    "FinetuneConfig",
    "GROUPS",
    "LOGGERS",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "PRIORITIES",
    "ParallelConfig",
    "PreferenceConfig",
    "RequeueConfig",
    "SITE_POLICIES",
    "SITE_SWEEPS",
    "ServeConfig",
    "SiteConfig",
    "TargetConfig",
    "TrainConfig",
    "XirangConfig",
]


@dataclass
class XirangConfig:
    """The composed root config."""

    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    requeue: RequeueConfig = field(default_factory=RequeueConfig)
    data: DataConfig = field(default_factory=DataConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    target: TargetConfig = field(default_factory=TargetConfig)  # read by xirang-plan only
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)  # xirang-pipeline's DPO stage


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "requeue": RequeueConfig,
    "data": DataConfig,
    "monitor": MonitorConfig,
    "comm": CommConfig,
    "eval": EvalConfig,
    "serve": ServeConfig,
    "target": TargetConfig,
    "finetune": FinetuneConfig,
    "preference": PreferenceConfig,
}
