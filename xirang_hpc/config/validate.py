"""Cross-group validation: everything that can be known wrong before a job is submitted.

``load_config`` turns Hydra's DictConfig into the typed :class:`XirangConfig` (running each
schema's ``__post_init__``), then :func:`validate` checks the relations between groups.
Every failure is a :class:`ConfigError` naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from xirang_hpc.config.errors import ConfigError, UnknownFieldError
from xirang_hpc.config.fields import drop_removed, unknown_field
from xirang_hpc.config.hf import apply_hf_model, apply_peft_finetune, is_peft_dir
from xirang_hpc.config.schema import ClusterConfig, DataConfig, ParallelConfig, XirangConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def _schema() -> DictConfig:
    """The schema as an OmegaConf node, built once per process (~35 ms): ``OmegaConf.merge`` copies its first
    argument, so the cached node is never changed."""
    return OmegaConf.structured(XirangConfig)


def _cli_overrides(hydra_node: object) -> list[str] | None:
    """The command line's overrides (``model=x``, ``model.n_layer=2``), or None where none is known (in a job)."""
    if isinstance(hydra_node, dict):
        task = (hydra_node.get("overrides") or {}).get("task")
        if task is not None:
            return list(task)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return None


def load_config(cfg: DictConfig) -> XirangConfig:
    """Convert a composed DictConfig to typed dataclasses and validate it."""
    return validate(to_typed(cfg))


def to_typed(cfg: DictConfig) -> XirangConfig:
    """A composed DictConfig as typed dataclasses, ``model.init_from`` (a Hugging Face dir) applied to
    ``model.*``, unknown fields refused with the nearest valid one; not yet :func:`validate`-d (``xirang-plan``
    chooses the layout that validation would check)."""
    overrides: list[str] | None = None
    try:
        # Hydra passes a struct-mode DictConfig; drop its own node if present.
        container = OmegaConf.to_container(cfg, resolve=True)
        overrides = _cli_overrides(container.pop("hydra", None))
        drop_removed(container)  # a config written before a field went still loads where it held the default
        if isinstance(container.get("model"), dict):  # model.init_from=<Hugging Face dir> fills/checks model.*
            container["model"] = apply_hf_model(container["model"], overrides)
            if is_peft_dir(container["model"].get("init_from")):  # a PEFT adapter: its LoRA shape, continued
                container["finetune"] = apply_peft_finetune(container.get("finetune") or {},
                                                            container["model"]["init_from"], overrides)
        typed = OmegaConf.merge(_schema(), container)
        obj = OmegaConf.to_object(typed)
    except (ConfigAttributeError, ConfigKeyError) as exc:  # +train.stepz=3: Hydra added it, the schema has none
        key = str(getattr(exc, "full_key", None) or "config")
        value = next((a.partition("=")[2] for a in overrides or [] if a.partition("=")[0].lstrip("+~") == key), None)
        raise UnknownFieldError(key, value, unknown_field(key, value, overrides or [])) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError(str(key), getattr(exc, "value", None), str(exc).splitlines()[0]) from None
    assert isinstance(obj, XirangConfig)
    return obj


def resolve_zero(p: ParallelConfig) -> ParallelConfig:
    """``p`` with its ZeRO stage and the older fields that also name it made to agree.

    ``parallel.zero=-1`` derives the stage from ``data_parallel`` (fsdp = 3) and ``optimizer_sharding``
    (1); an explicit stage sets them (2 and 3 run on FSDP2, 0 and 1 on DDP or FSDP2 replication), so
    configs written before the field existed mean what they meant. Contradictions are refused.
    """
    zero = p.zero
    if zero == -1:
        zero = 3 if p.data_parallel == "fsdp" else (1 if p.optimizer_sharding else 0)
    elif zero < 2 and p.data_parallel == "fsdp":
        raise ConfigError("parallel.zero", zero,
                          f"data_parallel=fsdp shards the weights (ZeRO-3); use parallel.zero=2 or 3 with fsdp, "
                          f"or parallel.data_parallel=ddp for ZeRO-{zero}")
    elif zero == 0 and p.optimizer_sharding:
        raise ConfigError("parallel.zero", zero, "parallel.optimizer_sharding=true is ZeRO-1; use parallel.zero=1 "
                          "(or 2/3), or optimizer_sharding=false")
    return dataclasses.replace(p, zero=zero, data_parallel="fsdp" if zero >= 2 else "ddp",
                               optimizer_sharding=zero >= 1)


def validate(cfg: XirangConfig) -> XirangConfig:
    """Check relations between groups and resolve derived values (``parallel.dp=-1``, ``parallel.zero=-1``)."""
    c = cfg.cluster
    cfg = dataclasses.replace(cfg, parallel=resolve_zero(cfg.parallel),
                              requeue=cfg.requeue.with_default_rates(c.nodes + c.spare_nodes, c.time_min))
    m, p, c, t = cfg.model, cfg.parallel, cfg.cluster, cfg.train
    world = c.world_size

    if m.n_head % p.tp or m.d_model % p.tp:
        ok = [d for d in _divisors(m.n_head) if m.d_model % d == 0 and world % d == 0]
        raise ConfigError(
            "parallel.tp",
            p.tp,
            f"tensor parallel degree must divide model.n_head={m.n_head} heads and "
            f"model.d_model={m.d_model}; choose parallel.tp from {ok}",
        )
    if m.n_kv_head % p.tp:
        ok = [d for d in _divisors(m.n_kv_head) if world % d == 0]
        raise ConfigError(
            "parallel.tp",
            p.tp,
            f"tensor parallelism shards the key/value heads: parallel.tp must divide model.n_kv_head="
            f"{m.n_kv_head}; choose parallel.tp from {ok}, or raise model.n_kv_head",
        )
    if m.ffn_dim % p.tp:
        raise ConfigError("parallel.tp", p.tp, f"must divide the MLP width {m.ffn_dim}; set model.d_ff")
    if m.vocab_size % p.tp:
        raise ConfigError("parallel.tp", p.tp, f"must divide model.vocab_size={m.vocab_size}")
    if p.pp > m.n_layer:
        raise ConfigError(
            "parallel.pp",
            p.pp,
            f"pipeline stages cannot exceed model.n_layer={m.n_layer}; use parallel.pp <= {m.n_layer}",
        )
    if p.schedule == "interleaved" and p.pp * p.virtual_stages > m.n_layer:
        raise ConfigError(
            "parallel.virtual_stages",
            p.virtual_stages,
            f"interleaved splits the model into pp*virtual_stages={p.pp * p.virtual_stages} stages, more than "
            f"model.n_layer={m.n_layer}; use parallel.virtual_stages <= {max(1, m.n_layer // p.pp)}",
        )
    rounds = max(1, p.microbatches * t.grad_accum // p.pp)
    if p.schedule == "interleaved" and (p.microbatches * t.grad_accum) % rounds:
        raise ConfigError(  # torch's ScheduleInterleaved1F1B runs the microbatches in rounds of ~pp
            "parallel.microbatches",
            p.microbatches,
            f"interleaved needs microbatches*grad_accum={p.microbatches * t.grad_accum} to be a multiple of "
            f"max(1, microbatches*grad_accum // pp)={rounds}; use a multiple of parallel.pp={p.pp}",
        )
    if p.schedule == "interleaved" and p.pp == 1:
        raise ConfigError("parallel.schedule", p.schedule, "interleaved is a pipeline schedule: set parallel.pp > 1")
    if c.tasks_per_node % p.tp:  # the one config-level check (the mesh placement then keeps each group on a node)
        ok = [d for d in _divisors(c.tasks_per_node) if m.n_head % d == 0 and m.d_model % d == 0]
        raise ConfigError(
            "parallel.tp",
            p.tp,
            f"tensor parallel groups stay inside a node: tp must divide cluster.tasks_per_node={c.tasks_per_node}; "
            f"choose parallel.tp from {ok}",
        )
    if world % (p.tp * p.pp):
        raise ConfigError(
            "parallel.tp",
            p.tp,
            f"tp*pp={p.tp * p.pp} must divide the world size {world} "
            f"(cluster.nodes={c.nodes} x cluster.tasks_per_node={c.tasks_per_node})",
        )
    _check_cp(cfg)
    dp = world // (p.tp * p.pp * p.cp) if p.dp == -1 else p.dp  # the one place parallel.dp=-1 is resolved
    if dp * p.cp * p.tp * p.pp != world:
        raise ConfigError(
            "parallel.dp",
            p.dp,
            f"dp*cp*tp*pp={dp * p.cp * p.tp * p.pp} must equal the world size {world}; "
            f"use parallel.dp={world // (p.tp * p.pp * p.cp)} or parallel.dp=-1 to derive it",
        )
    per_step = dp * t.grad_accum * p.microbatches
    if t.global_batch % per_step:
        raise ConfigError(
            "train.global_batch",
            t.global_batch,
            f"must be divisible by dp*train.grad_accum*parallel.microbatches={dp}*{t.grad_accum}*{p.microbatches}"
            f"={per_step}; use a multiple of {per_step} or change train.grad_accum / parallel.microbatches",
        )
    if not t.warmup_frac and t.warmup_steps > t.max_steps:
        raise ConfigError(
            "train.warmup_steps",
            t.warmup_steps,
            f"must not exceed train.max_steps={t.max_steps}; lower train.warmup_steps (or set train.warmup_frac, "
            "a fraction of the steps)",
        )
    if m.moe_experts and p.pp > 1 and m.moe_balance == "aux_loss":
        raise ConfigError("model.moe_balance", m.moe_balance, "the auxiliary load-balancing loss pools every MoE "
                          "layer's counts over the whole batch before its product, which pipeline stages do not "
                          "see (each holds some layers, and 1F1B runs a microbatch's backward before the next "
                          "one's forward); use model.moe_balance=bias (or none) with parallel.pp > 1, or parallel.pp=1")
    _check_ep(cfg, dp)
    if m.moe_experts and t.compile and p.recompute == "selective":
        # A MoE block is compiled in parts around its routing (runtime/compile.py); selective recompute replays
        # the block eager under a dispatch mode that compiled code cannot run in (a whole dense block's graph
        # holds its checkpoint region instead).
        raise ConfigError("train.compile", True, "a mixture-of-experts model compiles its blocks in parts (the "
                          "attention half and the router), which parallel.recompute=selective cannot replay; use "
                          "parallel.recompute=full or none with train.compile=true, or train.compile=false")
    if t.precision == "fp8" and p.tp > 1:  # the tensor-parallel plan shards nn.Linear, not torchao's Float8Linear
        raise ConfigError("train.precision", "fp8", "float8 linear layers are not tensor-parallel yet; use "
                          "parallel.tp=1 (data parallel, FSDP and pipelines work) or train.precision=bf16")
    if t.precision == "fp8" and cfg.finetune.adapters:
        raise ConfigError("train.precision", "fp8", "LoRA adapters wrap the linear layers that float8 training "
                          "would swap; use train.precision=bf16 with LoRA adapters")
    if m.tie_embeddings and p.pp > 1:
        raise ConfigError(
            "model.tie_embeddings",
            True,
            "tied input/output embeddings need the embedding and the head on one pipeline stage; "
            "use parallel.pp=1 (tp/dp/fsdp are fine) or model.tie_embeddings=false",
        )
    if c.spare_nodes and (c.executor != "slurm" or cfg.requeue.max_restarts_in_job == 0):
        raise ConfigError(
            "cluster.spare_nodes",
            c.spare_nodes,
            "spare nodes are used only by an in-job restart on Slurm; set requeue.max_restarts_in_job=1 or more "
            "(with a Slurm cluster) or cluster.spare_nodes=0",
        )
    data = _check_tokenizer(cfg)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp), data=data)


def cp_degrees(world: int, tp: int, pp: int, seq_len: int) -> list[int]:
    """Context-parallel degrees that fit: they divide the ranks left by tp*pp, and 2*cp divides ``seq_len``."""
    rest = world // (tp * pp) if world % (tp * pp) == 0 else 1
    return [d for d in _divisors(rest) if seq_len % (2 * d) == 0]


def _check_cp(cfg: XirangConfig) -> None:
    """``parallel.cp``: a degree that divides the world with tp and pp, and whose 2*cp chunks tile the sequence."""
    p, m, world = cfg.parallel, cfg.model, cfg.cluster.world_size
    if p.cp == 1:
        return
    ok = cp_degrees(world, p.tp, p.pp, m.seq_len)
    if world % (p.tp * p.pp * p.cp):
        raise ConfigError("parallel.cp", p.cp, f"cp*tp*pp={p.cp * p.tp * p.pp} must divide the world size {world}; "
                          f"choose parallel.cp from {ok}")
    if m.seq_len % (2 * p.cp):
        # Load-balanced causal chunking cuts every sequence into 2*cp equal chunks (rank i takes i and 2cp-1-i).
        raise ConfigError("parallel.cp", p.cp, f"2*cp={2 * p.cp} must divide model.seq_len={m.seq_len} (each "
                          f"sequence is cut into 2*cp equal chunks); choose parallel.cp from {ok}")


def _check_ep(cfg: XirangConfig, dp: int) -> None:
    """``parallel.ep``: experts sharded over ep of the data-parallel ranks (torchtitan's mesh rule).

    torchtitan requires ``dp_shard * cp * tp == efsdp * ep``: the expert-parallel ranks are borrowed from
    the data-parallel ones. Here (no cp; experts whole over tp, each tp position with its own expert groups)
    that is ``dp == (dp / ep) * ep``: ep divides the data-parallel degree, the experts are replicated over the
    other dp/ep ranks (DDP, HSDP) or FSDP2-sharded over them (FSDP2 without replicate groups: torchtitan's
    efsdp, E/dp experts' elements per rank), and the dense part stays data-parallel over all dp ranks. ep must
    also divide the expert count (E/ep per rank).
    """
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        if p.ep_bitwise:
            raise ConfigError("parallel.ep_bitwise", True, "has an effect only with parallel.ep > 1 (at ep=1 each "
                              "rank runs its own rows, as ep_bitwise makes the expert ranks do); leave it false")
        return
    if not m.moe_experts:
        raise ConfigError("parallel.ep", p.ep, "expert parallelism shards mixture-of-experts blocks, but "
                          "model.moe_experts=0 (a dense model); set model.moe_experts or parallel.ep=1")
    ok = [d for d in _divisors(m.moe_experts) if dp % d == 0]
    if m.moe_experts % p.ep or dp % p.ep:
        raise ConfigError("parallel.ep", p.ep,
                          f"expert-parallel ranks are taken from the data-parallel ranks (dp == dp/ep x ep, "
                          f"torchtitan's dp_shard*cp*tp == efsdp*ep rule), so ep must divide parallel.dp={dp} "
                          f"and model.moe_experts={m.moe_experts}; choose parallel.ep from {ok}")
    if p.dp_replicate > 1 and (dp // p.dp_replicate) % p.ep:
        ok = [d for d in ok if (dp // p.dp_replicate) % d == 0]
        raise ConfigError("parallel.ep", p.ep,
                          f"with HSDP the expert-parallel ranks are taken from one shard group of "
                          f"dp/dp_replicate={dp // p.dp_replicate} ranks; choose parallel.ep from {ok}")
    if p.ep_bitwise and p.microbatches * cfg.train.grad_accum > 1:
        raise ConfigError("parallel.ep_bitwise", True,
                          f"a change of ep continues bitwise only with one microbatch a step (with "
                          f"parallel.microbatches={p.microbatches} x train.grad_accum={cfg.train.grad_accum} an "
                          "expert adds its ranks before the microbatches, which ep=1 adds after); set both to 1 "
                          "or leave ep_bitwise false")


def tokenizer_file(spec: str) -> Path | None:
    """The tokenizer.json that ``data.tokenizer`` names (None for byte/bpe); ConfigError when missing."""
    if spec in ("byte", "bpe"):
        return None
    p = Path(spec).expanduser()
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        what = "a directory without tokenizer.json" if p.is_dir() else "no such file or directory"
        raise ConfigError("data.tokenizer", spec, f"{what}; use byte, bpe (trained by xirang-prepare), "
                          "a tokenizer.json path or an HF model dir holding tokenizer.json")
    return f.absolute()


def tokenizer_vocab_size(spec: str, bpe_vocab: int) -> int:
    """How many token ids ``data.tokenizer`` can produce (a tokenizer.json is read with ``tokenizers``)."""
    if spec == "byte":
        return 256
    if spec == "bpe":
        return bpe_vocab
    f = tokenizer_file(spec)
    try:
        from tokenizers import Tokenizer

        return int(Tokenizer.from_file(str(f)).get_vocab_size(with_added_tokens=True))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for a bad file
        raise ConfigError("data.tokenizer", spec,
                          f"{f} is not a readable tokenizer.json ({str(exc).splitlines()[0]})") from None


def _check_tokenizer(cfg: XirangConfig) -> DataConfig:
    """The tokenizer's vocabulary must fit the model's embedding; ``data.vocab_size=0`` becomes model.vocab_size."""
    d, m = cfg.data, cfg.model
    if d.tokenizer == "bpe":
        if d.vocab_size == 0:
            d = dataclasses.replace(d, vocab_size=m.vocab_size)
        if d.vocab_size < 257:
            raise ConfigError("data.vocab_size", d.vocab_size,
                              "a byte-level BPE needs at least 257 tokens (256 bytes + <|endoftext|>); "
                              "set data.vocab_size=... (and model.vocab_size at least as large)")
    n = tokenizer_vocab_size(d.tokenizer, d.vocab_size)
    if n > m.vocab_size:
        src = "data.vocab_size" if d.tokenizer == "bpe" else f"data.tokenizer={d.tokenizer}"
        raise ConfigError("model.vocab_size", m.vocab_size,
                          f"the tokenizer ({src}) has {n} tokens, more than model.vocab_size={m.vocab_size} "
                          f"embeddings; set model.vocab_size={n} or more")
    return d


def scheduling_class(c: ClusterConfig, priority: str) -> tuple[str | None, str | None]:
    """(partition, qos) that ``train.priority`` maps to on cluster ``c``, as its preset says.

    normal -> cluster.partition/qos; exploratory -> cluster.scavenger_partition/qos; high ->
    cluster.high_partition/qos. A class falls back to the normal partition or QOS for the half it
    leaves unset (a QOS-only site keeps one partition), and a class the preset names nothing for is
    refused: silently running exploratory work unpreemptible, or urgent work at normal priority,
    would defeat the point of asking for it.
    """
    if priority == "normal":
        return c.partition, c.qos
    prefix = {"exploratory": "scavenger", "high": "high"}.get(priority)
    if prefix is None:
        raise ConfigError("train.priority", priority, "choose one of exploratory, normal, high")
    partition, qos = getattr(c, f"{prefix}_partition"), getattr(c, f"{prefix}_qos")
    if not (partition or qos):
        raise ConfigError("train.priority", priority,
                          f"cluster {c.name!r} names no {prefix} partition/QOS; set cluster.{prefix}_partition "
                          f"or cluster.{prefix}_qos (e.g. cluster=testbed-qos), or use train.priority=normal")
    return partition or c.partition, qos or c.qos


def _check_dpo(cfg: XirangConfig) -> None:
    """``finetune.method=dpo``: preference pairs, on the layouts the DPO step runs (one process or DDP)."""
    dpo, pairs = cfg.finetune.method == "dpo", cfg.data.format == "pairs"
    if pairs and not dpo:
        raise ConfigError("data.format", "pairs", "preference pairs train with finetune.method=dpo; set it, or "
                          "use data.format=chat for supervised fine-tuning")
    if not dpo:
        return
    if not pairs:
        raise ConfigError("finetune.method", "dpo", f"needs preference pairs (data.format=pairs), not "
                          f"data.format={cfg.data.format}")
    p = cfg.parallel
    for name, value, ok in (("parallel.pp", p.pp, p.pp == 1), ("parallel.tp", p.tp, p.tp == 1),
                            ("parallel.data_parallel", p.data_parallel, p.data_parallel == "ddp")):
        if not ok:
            raise ConfigError(name, value, "finetune.method=dpo runs on one process or data parallel with ddp "
                              "only (the reference model and the paired forward are not carved or sharded); use "
                              "parallel.pp=1, parallel.tp=1, parallel.data_parallel=ddp")
    if cfg.train.loss_chunk_tokens:
        raise ConfigError("train.loss_chunk_tokens", cfg.train.loss_chunk_tokens,
                          "finetune.method=dpo sums log-probs from the full logits; set train.loss_chunk_tokens=0")
    if cfg.model.moe_experts:
        raise ConfigError("finetune.method", "dpo", "not with mixture-of-experts blocks (model.moe_experts) yet")


def check_runnable(cfg: XirangConfig) -> None:
    """Layout choices that are valid on their own but that the runtime cannot combine (after :func:`validate`)."""
    p = cfg.parallel
    if p.dp < 1:
        raise ConfigError("parallel.dp", p.dp, "unresolved: check_runnable needs a config from load_config/validate")
    dp = p.dp
    _check_comm_applies(cfg)
    _check_dpo(cfg)
    _check_cp_runnable(cfg)
    if cfg.finetune.adapters:
        if p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", True, "not yet with LoRA adapters (finetune.method=lora): "
                              "their tensor-parallel layout is tested without it; set "
                              "parallel.sequence_parallel=false (tensor parallelism itself works)")
        if cfg.model.moe_experts:
            raise ConfigError("finetune.method", "lora", "mixture-of-experts blocks have no dense MLP linears to "
                              "adapt; use finetune.method=full")
    if cfg.data.packing and p.sequence_parallel:
        raise ConfigError("data.packing", True, "packed samples' block-diagonal mask is not carried through the "
                          "sequence-parallel block boundary; set parallel.sequence_parallel=false or "
                          "data.packing=false")
    c = cfg.cluster
    scheduling_class(c, cfg.train.priority)
    if p.ep > 1 and p.zero == 1:
        raise ConfigError("parallel.zero", 1, "ZeRO-1 partitions whole parameters over the dp ranks, which "
                          "expert-parallel shards are not; with parallel.ep > 1 use parallel.zero=0, 2 or 3")
    if p.dp_replicate > 1 and p.data_parallel != "fsdp":
        raise ConfigError(
            "parallel.dp_replicate",
            p.dp_replicate,
            "replicate groups (HSDP) need parallel.data_parallel=fsdp (parallel.zero=2 or 3); with ddp leave it at 1",
        )
    if dp % p.dp_replicate:
        raise ConfigError("parallel.dp_replicate", p.dp_replicate, f"must divide the data parallel degree {dp}")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel", True, "sequence parallelism needs parallel.tp > 1")
    if p.sequence_parallel and cfg.model.seq_len % p.tp:
        raise ConfigError(
            "parallel.sequence_parallel", True, f"parallel.tp={p.tp} must divide model.seq_len={cfg.model.seq_len}"
        )


def _check_cp_runnable(cfg: XirangConfig) -> None:
    """Context parallelism composes with dp (DDP, FSDP2), tp, packed or padded rows; the rest is refused by name."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return
    why = f"parallel.cp={p.cp} runs without it so far"
    refused = [
        ("parallel.pp", p.pp, p.pp > 1, f"{why} (the pipeline's stage boundaries do not carry the sequence shards); "
         "use parallel.pp=1"),
        ("parallel.sequence_parallel", True, p.sequence_parallel, f"{why}; set parallel.sequence_parallel=false "
         "(tensor parallelism itself composes with cp)"),
        ("parallel.zero", 1, p.zero == 1, f"{why} (ZeRO-1 shards over dp only); use parallel.zero=0, 2 or 3"),
        ("parallel.ep", p.ep, p.ep > 1, f"{why} (the expert groups are cut from the dp ranks only); use "
         "parallel.ep=1 with parallel.cp, or parallel.cp=1"),
        ("finetune.method", cfg.finetune.method, cfg.finetune.method != "full", f"{why}; use finetune.method=full "
         "or parallel.cp=1"),
        ("train.compile", True, t.compile, f"{why} (the K/V all-gather sits inside each block); set "
         "train.compile=false"),
        ("comm.sync_period", cfg.comm.sync_period, cfg.comm.sync_period > 1 or cfg.comm.inter_node_budget > 0,
         f"{why}: the ranks of a cp group must stay identical every step; use comm.sync_period=1 and "
         "comm.inter_node_budget=0"),
    ]
    for name, value, bad, fix in refused:
        if bad:
            raise ConfigError(name, value, fix)


def _check_comm_applies(cfg: XirangConfig) -> None:
    """Refuse a bandwidth budget / sync period that the layout would silently not apply.

    Periodic cross-node averaging (local SGD) is installed by the DDP comm hook, which runs only
    under plain data parallelism (ddp, tp=1, pp=1) and only matters when the replicas span nodes.
    """
    p, comm, nodes = cfg.parallel, cfg.comm, cfg.cluster.nodes
    if comm.inter_node_budget > 0 and comm.sync_period == 1:
        raise ConfigError("comm.inter_node_budget", comm.inter_node_budget,
                          "comm.sync_period=1 (sync every step) overrides the budget, so it would have no effect; "
                          "set comm.sync_period=0 to derive the period from the budget, or leave the budget at 0")
    if comm.inter_node_budget <= 0 and comm.sync_period <= 1:
        return
    name, value = (("comm.sync_period", comm.sync_period) if comm.sync_period > 1
                   else ("comm.inter_node_budget", comm.inter_node_budget))
    if p.data_parallel != "ddp" or p.tp > 1 or p.pp > 1:
        raise ConfigError(name, value,
                          f"periodic cross-node averaging runs under plain DDP only (parallel.data_parallel=ddp, "
                          f"tp=1, pp=1), this layout is data_parallel={p.data_parallel} tp={p.tp} pp={p.pp}; "
                          f"use parallel.pp=1 parallel.tp=1 parallel.data_parallel=ddp, or leave {name} at its default")
    if nodes < 2:
        raise ConfigError(name, value,
                          f"cluster.nodes={nodes}: there is no inter-node link to save; use cluster.nodes >= 2 "
                          f"or leave {name} at its default")
