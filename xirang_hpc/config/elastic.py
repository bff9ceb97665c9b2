"""The same training on fewer nodes: the layout an in-job restart (or a drained requeue) shrinks to.

A restart on ``k`` of the config's ``cluster.nodes`` nodes keeps what is trained: the global batch,
the tensor and pipeline degrees and every optimisation field. Only data parallelism shrinks, by
``nodes / k``, and gradient accumulation grows by the same factor, so every optimizer step still
averages the gradient of the same ``train.global_batch`` sequences (each data-parallel rank reads
the contiguous slice of the step's batch that the larger group's ranks read together). Checkpoints
are layout-independent (torch.distributed.checkpoint), so the shrunk job resumes the newest one.

The job learns its node count from ``XIRANG_NODES`` (set by the in-job restart driver,
:mod:`xirang_hpc.batch.injob`); without it the config is used as submitted.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import check_runnable, validate

NODES_ENV = "XIRANG_NODES"


def shrink(cfg: XirangConfig, nodes: int) -> XirangConfig:
    """``cfg`` (validated, ``parallel.dp`` resolved) on ``nodes`` nodes; raises ConfigError when impossible.

    ``nodes == cfg.cluster.nodes`` returns ``cfg`` unchanged. A shrink needs the data-parallel degree
    to scale by a whole factor (``dp * nodes`` divisible by ``cluster.nodes``) and the tensor and
    pipeline groups to fit the remaining ranks; the error names the limit.
    """
    c, p = cfg.cluster, cfg.parallel
    if nodes == c.nodes:
        return cfg
    if not 1 <= nodes <= c.nodes:
        raise ConfigError("cluster.nodes", nodes, f"a restart runs on 1..cluster.nodes={c.nodes} nodes")
    if p.dp < 1:
        raise ConfigError("parallel.dp", p.dp, "unresolved: shrink needs a config from load_config/validate")
    if p.tp * p.pp * p.cp > nodes * c.tasks_per_node:  # a cp group shares each sequence: it cannot shrink
        what = f"cp*tp*pp={p.cp * p.tp * p.pp}" if p.cp > 1 else f"tp*pp={p.tp * p.pp}"
        raise ConfigError("cluster.nodes", nodes,
                          f"{what} ranks do not fit on {nodes} node(s) x {c.tasks_per_node} ranks")
    if (p.dp * nodes) % c.nodes or (cfg.train.grad_accum * c.nodes) % nodes:
        raise ConfigError("cluster.nodes", nodes,
                          f"data parallelism dp={p.dp} over {c.nodes} nodes does not shrink by a whole factor to "
                          f"{nodes} node(s); the restart needs dp*nodes/cluster.nodes to be an integer")
    out = copy.deepcopy(cfg)
    out.cluster.nodes = nodes
    out.parallel.dp = p.dp * nodes // c.nodes
    # Same global batch: fewer data-parallel ranks accumulate more micro-steps.
    out.train.grad_accum = cfg.train.grad_accum * c.nodes // nodes
    out = validate(out)
    check_runnable(out)
    return out


def shrink_options(cfg: XirangConfig) -> list[int]:
    """Node counts below ``cluster.nodes`` that :func:`shrink` accepts, not below ``requeue.min_nodes``."""
    out = []
    for k in range(max(1, cfg.requeue.min_nodes), cfg.cluster.nodes):
        try:
            shrink(cfg, k)
        except ConfigError:
            continue
        out.append(k)
    return out


def for_environment(cfg: XirangConfig, env: Mapping[str, str]) -> XirangConfig:
    """``cfg`` shrunk to ``$XIRANG_NODES`` when the in-job restart driver set it."""
    value = env.get(NODES_ENV, "")
    if not value:
        return cfg
    try:
        nodes = int(value)
    except ValueError:
        raise ConfigError(NODES_ENV, value, "must be a node count (set by the in-job restart driver)") from None
    return shrink(cfg, nodes)
