"""Every field of every config group has an effect, or a non-default value is refused before launch.

The table below names, for each field of ``config.schema.GROUPS``, a non-default value and where
its effect shows:

- an *observer*: a real function of the launcher or runtime applied to the validated config (the
  run directory's identity hash, the sbatch parameters, the parallel degrees, the learning-rate
  schedule, the requeue decisions, the retention plan, the watchdog thresholds, the serving limits,
  the comm bucket, the hardware preset, thread and backend choice); the test asserts that the
  observed value changes;
- ``REFUSED``: validation (``load_config`` + ``check_runnable``) raises a ``ConfigError`` that
  names the field;
- ``reads(module)``: the field is consumed inside the running job or a server, where a cheap
  observer does not exist; the test asserts that ``module`` really reads the field (an attribute
  access ``<x>.<field>`` or the key ``"<field>"`` in its source), so a field nothing reads any
  more fails here.

A new schema field without an entry fails ``test_every_field_is_covered``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf

from xirang_hpc.checkpoint.retention import RetentionPolicy, steps_to_keep
from xirang_hpc.config.errors import ConfigError, UnknownFieldError
from xirang_hpc.config.fields import REMOVED
from xirang_hpc.config.schema import GROUPS, LoraConfig, XirangConfig
from xirang_hpc.config.schema.cluster import ContainerConfig
from xirang_hpc.config.schema.finetune import DpoConfig
from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.monitor.watchdog import thresholds_for
from xirang_hpc.planner.hardware import hardware_for
from xirang_hpc.runtime.comm.install import parse_bucket
from xirang_hpc.runtime.data_parallel import adamw_impl
from xirang_hpc.runtime.dist import pick_backend, threads_per_rank
from xirang_hpc.runtime.parallel_dims import Layout, ParallelDims
from xirang_hpc.runtime.policy import REASONS, History, decide
from xirang_hpc.runtime.schedule import lr_at
from xirang_hpc.serve.run import limits_for
from xirang_hpc.submit.executors import local_python
from xirang_hpc.submit.rundir import run_dir_for
from xirang_hpc.submit.slurm import sbatch_parameters

REFUSED = "refused"


def identity(cfg: XirangConfig) -> str:
    return str(run_dir_for(cfg))


def sbatch(cfg: XirangConfig) -> dict[str, Any]:
    return sbatch_parameters(cfg.cluster, cfg.train.priority)


def dims(cfg: XirangConfig) -> tuple[int, ...]:
    return ParallelDims.from_config(cfg.parallel, cfg.cluster.world_size).shape


def zero_stage(cfg: XirangConfig) -> int:
    return Layout(ParallelDims.from_config(cfg.parallel, cfg.cluster.world_size), (), cfg.parallel).zero


def lr_schedule(cfg: XirangConfig) -> list[float]:
    return [lr_at(s, cfg.train) for s in range(0, cfg.train.end_step + 1, 5)]


def requeue_decisions(cfg: XirangConfig) -> list[Any]:
    spent = History(days=0.5, used={"failures": 6, "preemptions": 6, "timeouts": 6})  # the rates' budgets
    return [decide(r, n, cfg.requeue, h) for r in [*REASONS, "terminated"] for n in range(7) for h in (None, spent)]


def retention(cfg: XirangConfig) -> list[int]:
    c = cfg.checkpoint
    return sorted(steps_to_keep(list(range(1, 200)), RetentionPolicy(c.keep_last, c.keep_every, tuple(c.pinned))))


def watchdog(cfg: XirangConfig) -> Any:
    return thresholds_for(dataclasses.asdict(cfg.monitor))


def serve_limits(cfg: XirangConfig) -> Any:
    return limits_for(cfg.serve, cfg.model.seq_len)


def bucket(cfg: XirangConfig) -> Any:
    size, tuner = parse_bucket(cfg.comm)
    return size, None if tuner is None else (tuner.candidates, tuner.steps_each)


def hardware(cfg: XirangConfig) -> Any:
    return hardware_for(cfg.cluster)


def threads(cfg: XirangConfig) -> int:
    return threads_per_rank(cfg.cluster.threads_per_rank, cfg.cluster.tasks_per_node)


def backend(cfg: XirangConfig) -> str:
    return pick_backend(cfg.cluster.backend, "xpu:0")  # what an accelerator rank's process group gets


def device(cfg: XirangConfig) -> str:
    from types import SimpleNamespace

    import torch

    from xirang_hpc.runtime.device import decide

    gpus = SimpleNamespace(is_available=lambda: True, current_accelerator=lambda: torch.device("cuda"),
                           device_count=lambda: 2)  # the decision on a node with two GPUs
    return str(decide(cfg.cluster.device, 1, "auto", accel=gpus))


def adamw_kwargs(cfg: XirangConfig) -> dict[str, bool]:
    return adamw_impl(cfg.train.optimizer_impl, "cpu")


# A directory that passes as a PEFT adapter at validation (serve.adapters checks adapter_config.json only).
_ADAPTER_DIR = Path(tempfile.mkdtemp(prefix="xirang-fields-adapter-"))
(_ADAPTER_DIR / "adapter_config.json").write_text("{}")


def reads(module: str) -> tuple[str, str]:
    return ("reads", module)


EXPLORATORY = ["train.priority=exploratory"]
# finetune.method=dpo runs on one process or ddp: the default layout's pipeline and tensor degrees off
DPO = ["finetune.method=dpo", "data.format=pairs", "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1"]
PURE_DP = ["parallel.pp=1", "parallel.microbatches=1"]
# "group.field": (non-default value, observer | REFUSED | reads(module), extra overrides for context)
FIELDS: dict[str, tuple[Any, Any, list[str]]] = {
    # model: what is trained -> the run's identity (and the model built from it)
    **{f"model.{k}": (v, identity, []) for k, v in {
        "name": "other", "n_layer": 6, "n_head": 2, "n_kv_head": 2, "d_model": 32, "d_ff": 96, "vocab_size": 512,
        "seq_len": 32, "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False, "norm_eps": 1e-6,
        "init_std": 0.01, "init_from": "w.safetensors"}.items()},
    "model.rope_theta": (500000.0, identity, ["model.pos=rope"]),
    "model.tie_embeddings": (True, identity, PURE_DP),  # one stage holds embedding and head
    "model.attn_qkv_bias": (True, identity, []),
    "model.d_head": (16, identity, []),
    "model.qk_norm": (True, identity, ["model.norm=rmsnorm"]),
    "model.rope_scaling": ("linear", identity, ["model.pos=rope"]),
    "model.rope_factor": (2.0, identity, ["model.pos=rope", "model.rope_scaling=linear"]),
    **{f"model.{k}": (v, identity, ["model.pos=rope", "model.rope_scaling=llama3", "model.rope_factor=8"])
       for k, v in {"rope_low_freq_factor": 2.0, "rope_high_freq_factor": 8.0, "rope_original_max_pos": 64}.items()},
    # mixture of experts: data-parallel only, SwiGLU experts
    "model.moe_experts": (4, identity, ["model.mlp=swiglu", *PURE_DP, "parallel.tp=1"]),
    **{f"model.{k}": (v, identity, ["model.mlp=swiglu", "model.moe_experts=8", *PURE_DP, "parallel.tp=1"])
       for k, v in {"moe_top_k": 1, "moe_ffn_hidden": 64, "moe_shared_ffn_hidden": 64, "moe_score": "sigmoid",
                    "moe_norm_topk": False, "moe_balance": "bias", "moe_aux_coef": 0.001, "moe_bias_rate": 0.01,
                    "moe_every": 2, "moe_first_dense": 1}.items()},
    # cluster: the batch script, the hardware preset, the job's threads and backend
    "cluster.name": ("renamed", reads("xirang_hpc.submit.slurm"), []),
    "cluster.executor": ("slurm", reads("xirang_hpc.cli.train"), []),
    **{f"cluster.{k}": (v, sbatch, []) for k, v in {
        "nodes": 1, "tasks_per_node": 4, "gpus_per_node": 1, "cpus_per_task": 2, "mem_gb": 8.0, "time_min": 90,
        "partition": "gpu", "qos": "high", "account": "proj", "constraint": "a100", "exclude": "n3",
        "signal_delay_s": 120, "array_parallelism": 8, "setup": ["module load cuda"], "srun_args": ["--exclusive"],
        "min_time_min": 30}.items()},
    "cluster.spare_nodes": (1, sbatch, ["cluster.executor=slurm", "requeue.max_restarts_in_job=1"]),
    "cluster.scavenger_partition": ("low", sbatch, [*EXPLORATORY, "cluster.scavenger_qos=scav"]),
    "cluster.scavenger_qos": ("scav", sbatch, [*EXPLORATORY, "cluster.scavenger_partition=low"]),
    "cluster.high_partition": ("urgent", sbatch, ["train.priority=high", "cluster.high_qos=top"]),
    "cluster.high_qos": ("top", sbatch, ["train.priority=high", "cluster.high_partition=urgent"]),
    "cluster.qos_names": (["normal"], REFUSED, ["cluster.qos=high"]),  # high is not one of the site's QOS
    "cluster.threads_per_rank": (3, threads, []),
    "cluster.omp_wait_policy": ("active", sbatch, []),
    "cluster.preload": (False, lambda cfg: local_python(cfg.cluster), []),  # the local executor's task command
    "cluster.backend": ("nccl", backend, []),
    "cluster.device": ("cpu", device, []),
    "cluster.gpu": ("h100", hardware, []),
    "cluster.hardware": ({"peak_tflops": 123.0}, hardware, []),
    "cluster.sites": ([{"name": "alpha"}], REFUSED, []),  # sites are Slurm clusters; cluster=local is not one
    "cluster.site_policy": ("quota", reads("xirang_hpc.submit.sites.placement"), []),
    "cluster.container": (ContainerConfig(image="/images/train.sif", runtime="apptainer"),
                          reads("xirang_hpc.slurm.container"), []),
    "cluster.site_stay_s": (60.0, reads("xirang_hpc.submit.sites.placement"), []),
    "cluster.site_migrate_wait_s": (30.0, reads("xirang_hpc.submit.sites.moves"), []),
    "cluster.site_auto_migrate": (False, reads("xirang_hpc.submit.sites.moves"), []),
    "cluster.site_sweep": ("spread", reads("xirang_hpc.submit.sweep"), []),
    "cluster.price_per_gpu_hour": (2.5, reads("xirang_hpc.submit.plan_target"), []),  # xirang-plan's cost
    # parallel: the degrees, or refused where the layout cannot apply the choice
    "parallel.dp": (3, REFUSED, []),
    "parallel.tp": (2, dims, []),
    "parallel.pp": (1, dims, []),
    "parallel.cp": (2, dims, PURE_DP),  # a cp mesh dimension; dp derived from the rest
    "parallel.data_parallel": ("fsdp", dims, []),
    "parallel.dp_replicate": (2, REFUSED, []),  # ddp has no replicate groups
    "parallel.microbatches": (2, reads("xirang_hpc.runtime.parallelize"), []),
    "parallel.schedule": ("gpipe", reads("xirang_hpc.runtime.parallelize"), []),
    "parallel.virtual_stages": (3, REFUSED, ["parallel.schedule=interleaved"]),  # 2 x 3 stages > 4 layers
    "parallel.recompute": ("full", reads("xirang_hpc.runtime.parallelize"), []),
    "parallel.sequence_parallel": (True, REFUSED, []),  # needs tp > 1
    "parallel.optimizer_sharding": (True, zero_stage, []),  # ZeRO-1 (also under dp2 x pp2)
    "parallel.zero": (2, dims, []),  # ZeRO-2 runs on FSDP2: dp becomes the shard dimension
    "parallel.auto": (True, reads("xirang_hpc.submit.autoplan"), []),
    "parallel.ep": (2, REFUSED, []),  # the default model is dense: no experts to spread
    "parallel.ep_bitwise": (True, REFUSED, []),  # no effect at ep=1
    # train: what is trained -> identity; the schedule; how the loop runs
    **{f"train.{k}": (v, identity, []) for k, v in {
        "seed": 7, "max_steps": 400, "global_batch": 64, "lr": 1e-3, "min_lr_ratio": 0.5, "warmup_steps": 5,
        "warmup_frac": 0.25,
        "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.99, "grad_clip": 0.5, "precision": "bf16"}.items()},
    "train.name": ("other", identity, []),
    "train.runs_root": ("elsewhere", identity, []),
    "train.run_dir": ("/tmp/xirang-explicit-run", identity, []),
    "train.grad_accum": (3, REFUSED, []),  # global batch 32 is not a multiple of dp2 x 3
    "train.extend_to": (400, lr_schedule, []),  # the schedule now decays towards step 400
    "train.after_active": (True, reads("xirang_hpc.submit.slurm"), []),
    "train.eval_every": (10, reads("xirang_hpc.runtime.trainer"), []),
    "train.eval_batches": (2, reads("xirang_hpc.runtime.trainer"), []),
    "train.log_every": (5, reads("xirang_hpc.runtime.trainer"), []),
    "train.wait": (True, reads("xirang_hpc.submit.slurm"), []),
    "train.priority": ("exploratory", REFUSED, []),  # cluster=local names no scavenger partition
    "train.resume_from": (10, reads("xirang_hpc.submit.preflight"), []),
    "train.loggers": (["tensorboard"], reads("xirang_hpc.monitor.tracking"), []),
    "train.mlflow_uri": ("file:/tmp/mlruns", reads("xirang_hpc.monitor.tracking"), ["train.loggers=[mlflow]"]),
    "train.share_group": ("root", reads("xirang_hpc.submit.launch"), []),
    "train.loss_chunk_tokens": (4096, reads("xirang_hpc.runtime.parallelize"), []),
    "train.compile": (True, reads("xirang_hpc.runtime.parallelize"), []),
    "train.optimizer_impl": ("fused", adamw_kwargs, []),
    # checkpoint: retention, the manager, the tuner
    "checkpoint.enabled": (False, reads("xirang_hpc.job.training"), []),
    "checkpoint.every_steps": (7, reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.keep_last": (1, retention, []),
    "checkpoint.keep_every": (50, retention, []),
    "checkpoint.pinned": ([5], retention, []),
    "checkpoint.async_save": (False, reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.compression": ("gzip", reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.dedup": (True, reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.verify_checksums": (False, reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.on_no_valid": ("fresh", reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.auto_interval": (True, reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.mtbf_hours": (2.0, reads("xirang_hpc.checkpoint.trainer_hook"), ["checkpoint.auto_interval=true"]),
    "checkpoint.dir_mode": (0o750, reads("xirang_hpc.submit.preflight"), []),
    "checkpoint.in_memory": (True, reads("xirang_hpc.checkpoint.trainer_hook"), []),
    "checkpoint.memory_every_steps": (3, reads("xirang_hpc.checkpoint.trainer_hook"), ["checkpoint.in_memory=true"]),
    "checkpoint.memory_dir": ("/dev/shm/other", reads("xirang_hpc.checkpoint.trainer_hook"),
                              ["checkpoint.in_memory=true"]),
    # requeue: the decisions for every stop reason and restart count
    **{f"requeue.{k}": (v, requeue_decisions, []) for k, v in {
        "enabled": False, "max_requeues": 1, "on_preemption": False, "on_timeout": False, "on_node_failure": False,
        "on_nonzero_exit": True, "backoff_s": 30, "start_now": True, "failures_per_day": 5.0,
        "preemptions_per_day": 0.0, "timeouts_per_day": 0.0, "budget_burst": 20}.items()},
    "requeue.exclude_failed_nodes": (False, reads("xirang_hpc.batch.supervise"), []),
    "requeue.max_restarts_in_job": (3, reads("xirang_hpc.batch.injob"), []),  # the default preset says 2
    "requeue.min_nodes": (1, reads("xirang_hpc.config.elastic"), []),
    # data: what is trained on -> identity; where and how it is stored
    "data.corpus": ("/some/corpus", identity, []),
    "data.tokenizer": ("bpe", identity, ["model.vocab_size=512"]),
    "data.vocab_size": (300, REFUSED, []),  # only for a trained BPE tokenizer (byte here)
    "data.text_field": ("content", identity, []),
    "data.on_bad_record": ("skip", identity, []),
    "data.format": ("chat", identity, []),
    "data.train_on": ("last", identity, ["data.format=chat"]),
    "data.packing": (True, identity, ["data.format=chat"]),
    "data.overlong": ("drop", identity, ["data.format=chat"]),
    "data.val_fraction": (0.1, identity, []),
    "data.split_seed": (3, identity, []),
    "data.out_dir": ("data/other", reads("xirang_hpc.cli.train"), []),
    "data.shard_tokens": (1024, reads("xirang_hpc.data.prepare"), []),
    # monitor: the watchdog's thresholds; the rest inside the job
    **{f"monitor.{k}": (v, watchdog, []) for k, v in {
        "hang_s": 60.0, "hang_k": 5.0, "hang_min_s": 30.0, "collective_timeout_s": 0.0, "stale_s": 20.0,
         "straggler_k": 3.0, "straggler_min_s": 0.5, "straggler_window": 9}.items()},
    "monitor.enabled": (False, reads("xirang_hpc.job.training"), []),
    "monitor.heartbeat_s": (2.0, reads("xirang_hpc.monitor.trainer_hook"), []),
    "monitor.abort_on_hang": (False, reads("xirang_hpc.monitor.watchdog"), []),
    "monitor.abort_on_dead": (False, reads("xirang_hpc.monitor.watchdog"), []),
    "monitor.stack_signal": ("SIGUSR1", reads("xirang_hpc.monitor.trainer_hook"), []),
    "monitor.peak_tflops": (100.0, reads("xirang_hpc.monitor.tracking"), []),
    # comm: the bucket, refusals where the layout cannot apply a budget, the averager
    "comm.hierarchical": (False, reads("xirang_hpc.runtime.comm.install"), []),
    "comm.bucket": ("auto", bucket, []),
    "comm.auto_candidates_mb": ([2.0, 8.0], bucket, ["comm.bucket=auto"]),
    "comm.auto_steps": (4, bucket, ["comm.bucket=auto"]),
    "comm.inter_node_budget": (0.25, REFUSED, []),  # dp2 x pp2: no DDP comm hook to apply it
    "comm.sync_period": (8, REFUSED, []),  # idem
    "comm.calibration_steps": (5, reads("xirang_hpc.runtime.comm.install"), [*PURE_DP, "comm.inter_node_budget=0.5"]),
    "comm.outer_optimizer": ("nesterov", reads("xirang_hpc.runtime.comm.install"), [*PURE_DP, "comm.sync_period=4"]),
    "comm.outer_lr": (0.5, reads("xirang_hpc.runtime.comm.install"), [*PURE_DP, "comm.sync_period=4"]),
    "comm.outer_momentum": (0.5, reads("xirang_hpc.runtime.comm.install"), [*PURE_DP, "comm.sync_period=4"]),
    "comm.timeout_s": (60.0, reads("xirang_hpc.runtime.comm.install"), []),
    # eval: inside the eval stage
    **{f"eval.{k}": (v, reads("xirang_hpc.eval.evaluate"), []) for k, v in {
        "batches": 4, "batch_size": 2, "seed": 5, "sample_prompt": "class", "sample_tokens": 8,
        "max_val_loss": 3.0, "device": "cpu"}.items()},
    "eval.step": (100, reads("xirang_hpc.job.stages"), []),
    # eval.harness_*: lm-evaluation-harness inside the eval stage
    "eval.harness_tasks": (["xirang_heldout_mc"], reads("xirang_hpc.eval.evaluate"), []),
    **{f"eval.harness_{k}": (v, reads("xirang_hpc.eval.harness"), ["eval.harness_tasks=[xirang_heldout_mc]"])
       for k, v in {"limit": 10, "num_fewshot": 2, "include": "/tmp"}.items()},
    # serve: the request limits; the rest configure the server
    "serve.max_prompt_tokens": (16, serve_limits, []),
    "serve.max_new_tokens": (32, serve_limits, []),
    **{f"serve.{k}": (v, reads("xirang_hpc.serve.run"), []) for k, v in {
        "host": "0.0.0.0", "port": 9000, "max_batch": 4, "token_env": "MY_TOKEN", "duration_s": 5.0,
        "read_timeout_s": 5.0, "model_name": "m", "keys_file": "keys.json", "metrics_public": True,
        "device": "cpu"}.items()},
    "serve.adapters": ({"a": str(_ADAPTER_DIR)}, reads("xirang_hpc.serve.run"), []),
    # finetune: what is trained -> the run's identity (and the adapters built from it)
    "finetune.method": ("lora", identity, []),
    "finetune.lora": (LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "k_proj"]), identity,
                      ["finetune.method=lora"]),
    "finetune.dpo": (DpoConfig(beta=0.5, lora=True), identity, DPO),
    # preference: the pipeline's DPO stage, derived from the pipeline's config on the login node
    "preference.corpus": ("pairs.jsonl", reads("xirang_hpc.submit.preference"), []),
    **{f"preference.{k}": (v, reads("xirang_hpc.submit.preference"), ["preference.corpus=pairs.jsonl"])
       for k, v in {"out_dir": "data/my-pairs", "beta": 0.5, "lora": True, "steps": 7, "lr": 1e-5}.items()},
    # target: what xirang-plan plans for (no training run reads it)
    **{f"target.{k}": (v, reads("xirang_hpc.submit.plan_target"), []) for k, v in {
        "loss": 2.5, "tokens": 1e9, "compute": 1e20, "deadline": "36h", "budget": "5000gpuh",
        "fit": "/tmp/scaling_fit.json"}.items()},
}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | dict):
        return repr(v).replace("'", "")
    return str(v)


@cache
def _loaded(overrides: tuple[str, ...]) -> XirangConfig:
    cfg = load_config(compose_cfg(list(overrides)))
    check_runnable(cfg)
    return cfg


def _load(overrides: list[str]) -> XirangConfig:
    """The validated config of ``overrides``, loaded once per test process (most tests share the same base);
    each call gets its own copy. A refused one raises again on every call (exceptions are not cached)."""
    return copy.deepcopy(_loaded(tuple(overrides)))


@cache
def _attribute_reads(module: str) -> frozenset[str]:
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # cfg["hang_s"] / cfg.get("hang_s"): a config passed on as a dict (to the watchdog process)
    keys = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return frozenset(attrs | keys)


def test_every_field_is_covered() -> None:
    fields = {f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    assert sorted(fields - FIELDS.keys()) == [], "new config fields: say where their effect shows (or refuse them)"
    assert sorted(FIELDS.keys() - fields) == [], "entries for fields that no longer exist"


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_a_non_default_value_changes_something_or_is_refused(key: str) -> None:
    value, effect, context = FIELDS[key]
    group, name = key.split(".")
    base_over = list(context)
    changed = [*base_over, f"{key}={_value(value)}"]
    if key == "cluster.hardware":  # a dict: add one entry
        changed = [*base_over, "+cluster.hardware.peak_tflops=123.0"]
    if key == "serve.adapters":  # a dict of name -> directory: add one entry, as a config adds them
        changed = [*base_over, f"+serve.adapters.a={_ADAPTER_DIR}"]
    if dataclasses.is_dataclass(value):  # a nested group: its non-default fields, one override each
        default = type(value)()
        changed = [*base_over, *(f"{key}.{f.name}={_value(getattr(value, f.name))}" for f in dataclasses.fields(value)
                                 if getattr(value, f.name) != getattr(default, f.name))]
    base = _load(base_over)
    assert getattr(getattr(base, group), name) != value, f"{key}: the test value is the default"
    if effect == REFUSED:
        with pytest.raises(ConfigError) as err:
            _load(changed)
        assert key in str(err.value), f"refused, but the message does not name {key}: {err.value}"
        return
    cfg = _load(changed)
    assert getattr(getattr(cfg, group), name) == value
    if isinstance(effect, tuple):
        module = effect[1]
        assert name in _attribute_reads(module), f"{module} no longer reads {key}"
        return
    observe: Callable[[XirangConfig], Any] = effect
    assert observe(cfg) != observe(base), f"{key}={value!r} changes nothing that {observe.__name__} sees"


def test_removed_fields_load_at_their_old_default_and_are_refused_with_the_replacement_otherwise() -> None:
    # A config written while the test-only monitor.debug_slow_* fields existed (a queued job's job_config.json,
    # a run's saved state) carries them at their defaults: it still loads, to the same config.
    base = OmegaConf.to_container(compose_cfg([]), resolve=True)
    old = {**base, "monitor": {**base["monitor"], **{k.split(".")[1]: d for k, (d, _) in REMOVED.items()}}}
    assert load_config(OmegaConf.create(old)) == load_config(OmegaConf.create(base))
    assert not {f.name for f in dataclasses.fields(GROUPS["monitor"])} & {k.split(".")[1] for k in REMOVED}
    # One that asked for a slow-down is refused, naming the field and the environment variable to set instead.
    for key, value, env in [("debug_slow_rank", 3, "XIRANG_TESTPOINT_SLOW=rank=3"),
                            ("debug_slow_steps", [8, 9], "XIRANG_TESTPOINT_SLOW=steps=8+9"),
                            ("debug_slow_save_s", 0.6, "XIRANG_TESTPOINT_SLOW=save_s=0.6")]:
        with pytest.raises(UnknownFieldError) as err:
            load_config(OmegaConf.create({**old, "monitor": {**old["monitor"], key: value}}))
        assert f"monitor.{key}" in str(err.value) and env in str(err.value), err.value


@pytest.mark.parametrize("key", ["train.lr", "train.grad_clip", "comm.outer_lr", "monitor.hang_s",
                                 "checkpoint.mtbf_hours", "cluster.mem_gb", "model.init_std", "serve.duration_s"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused_with_the_field_named(key: str, bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load([f"{key}={bad}"])
    assert key in str(err.value)


def test_lr_schedule_observer_sees_the_schedule_fields() -> None:
    """The schedule fields also reach the learning rate itself (not only the run identity)."""
    base = _load([])
    for over in ("train.lr=1e-3", "train.min_lr_ratio=0.5", "train.warmup_steps=5", "train.max_steps=400",
                 "train.warmup_frac=0.25"):
        assert lr_schedule(_load([over])) != lr_schedule(base), over


def test_warmup_frac_is_a_share_of_each_runs_steps() -> None:
    """``train.warmup_frac`` replaces ``train.warmup_steps``: the LR peaks at the same share of every run, and
    a warm-up longer than the run is no error then (the fraction decides)."""
    from xirang_hpc.runtime.schedule import lr_at

    for steps in (40, 400):
        t = _load(["train.warmup_frac=0.25", f"train.max_steps={steps}", "train.warmup_steps=300"]).train
        assert t.warmup == steps // 4
        lrs = [lr_at(s, t) for s in range(steps)]
        assert max(range(steps), key=lrs.__getitem__) == steps // 4 - 1 and lrs[steps // 4 - 1] == t.lr
        assert all(a < b for a, b in zip(lrs[: steps // 4 - 1], lrs[1: steps // 4]))
    assert _load([]).train.warmup == 20  # unset: train.warmup_steps
