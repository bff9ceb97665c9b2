"""Recovery from memory: replica placement, the fallback rules, and the store in one process (real tmpfs files)."""

from __future__ import annotations

import json
import stat

import pytest
import torch

from xirang_hpc.checkpoint.manager import CheckpointManager, LoadResult
from xirang_hpc.checkpoint.memory import (
    Decision,
    MemoryStore,
    decide,
    holders,
    replica_partners,
    transfers,
)
from xirang_hpc.checkpoint.naming import memory_root
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import CheckpointConfig


def _nodes(n: int, per: int) -> list[str]:
    return [f"n{1 + r // per}" for r in range(n * per)]


def test_replicas_go_to_the_same_local_rank_of_the_next_node() -> None:
    assert replica_partners(_nodes(2, 2)) == [2, 3, 0, 1]
    assert replica_partners(_nodes(3, 2)) == [2, 3, 4, 5, 0, 1]
    assert replica_partners(_nodes(1, 4)) == [None] * 4  # one node: nowhere else to put a replica
    # Uneven nodes (a shrunk or odd allocation): partners wrap around the next node's ranks.
    assert replica_partners(["a", "a", "a", "b"]) == [3, 3, 3, 0]


@pytest.mark.parametrize("n,per", [(2, 1), (2, 2), (3, 2), (4, 4), (5, 3)])
def test_any_single_node_loss_leaves_every_shard_on_a_surviving_node(n: int, per: int) -> None:
    nodes = _nodes(n, per)
    partners = replica_partners(nodes)
    where = holders(nodes, partners)
    for r, p in enumerate(partners):
        assert p is not None and nodes[p] != nodes[r], (r, p)  # the replica is never on the rank's own node
    for lost in set(nodes):
        for r in range(len(nodes)):
            assert where[r] - {lost}, f"shard of rank {r} only on lost node {lost}"


def _report(node: str, steps: dict[int, list[int]], world: int) -> dict:
    return {"node": node, "steps": {s: {b: {"world_size": world, "files": {}} for b in bs} for s, bs in steps.items()}}


def test_newest_complete_step_is_used_and_the_sources_are_named() -> None:
    # n1 holds its own bundles 0,1 and the replicas of 2,3 for steps 10 and 12; n2 was lost.
    reps = [_report("n1", {10: [0, 1, 2, 3], 12: [0, 1, 2, 3]}, 4)] * 2
    d = decide(reps, fs_step=10)
    assert d.step == 12 and d.world_size == 4 and d.sources == {0: [0, 1], 1: [0, 1], 2: [0, 1], 3: [0, 1]}


def test_an_incomplete_newest_step_falls_back_to_an_older_complete_one() -> None:
    reps = [_report("n1", {10: [0, 1, 2, 3], 12: [0, 1]}, 4), _report("n1", {10: [0, 1, 2, 3], 12: [0, 1]}, 4)]
    assert decide(reps, fs_step=None).step == 10
    d = decide(reps, fs_step=11)  # the complete one is older than the filesystem's
    assert d.step is None and "older than the filesystem checkpoint (step 11)" in d.reason
    assert "step 12 lacks the shards of ranks [2, 3]" in d.reason


def test_incomplete_or_missing_memory_means_the_filesystem() -> None:
    d = decide([_report("n1", {12: [0, 1]}, 4)], fs_step=10)
    assert d.step is None and d.reason.startswith("memory copy incomplete") and "[2, 3]" in d.reason
    assert decide([_report("n1", {}, 4)], fs_step=10).reason == "no memory copy on the nodes of this attempt"
    assert decide([_report("n1", {10: [0]}, 1)], fs_step=10).step == 10  # same step: memory (no disk read)


def test_a_spare_node_receives_every_bundle_once_and_a_shrunk_node_nothing() -> None:
    d = Decision(12, 4, {0: [0, 1], 1: [0, 1], 2: [0, 1], 3: [0, 1]})
    assert transfers(d, ["n1", "n1", "n3", "n3"]) == [(0, 0, 2), (1, 0, 2), (2, 0, 2), (3, 0, 2)]
    assert transfers(d, ["n1", "n1"]) == []


def test_the_job_root_is_per_job_and_per_run_outside_slurm(tmp_path) -> None:
    a = memory_root("123", tmp_path / "run", str(tmp_path))
    assert a.parent == tmp_path and a.name.startswith("xirang-") and a.name.endswith("-123")
    b = memory_root("local job", tmp_path / "run", str(tmp_path))
    assert b != memory_root("local job", tmp_path / "other", str(tmp_path)) and "-local-" in b.name


def test_config_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match="checkpoint.memory_every_steps"):
        CheckpointConfig(memory_every_steps=-1)
    with pytest.raises(ConfigError, match="checkpoint.memory_dir"):
        CheckpointConfig(memory_dir="relative/shm")
    assert CheckpointConfig().in_memory is False


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)}}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(7, 5), "b": torch.zeros(5, dtype=torch.bfloat16)}}


def _mgr(tmp_path) -> CheckpointManager:
    store = MemoryStore(tmp_path / "shm" / "xirang-job", node="n1")
    return CheckpointManager(tmp_path / "ckpt", async_save=False, memory=store)


def test_memory_save_and_restore_in_one_process(tmp_path) -> None:
    mgr = _mgr(tmp_path)
    mgr.save(5, _state(5), state={"step": 5}, rank_state={"rank": 0}, to_memory=True)
    mgr.save(7, _state(7), state={"step": 7}, rank_state={"rank": 0}, to_disk=False, to_memory=True)
    d = tmp_path / "shm" / "xirang-job" / "n1"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(d.parent.stat().st_mode) == 0o700
    assert [p.name for p in d.iterdir()] == ["step_7"]  # only the newest step is kept
    assert json.loads((d / "step_7" / "bundle_0.json").read_text())["files"].keys() >= {
        "rank_0.h5", "rank_0.json", "metadata.json", "state.json"}
    got = _zeros()
    res = mgr.load_memory(got, fs_step=5)
    assert isinstance(res, LoadResult) and res.source == "memory" and res.step == 7
    assert res.state == {"step": 7} and res.rank_state == {"rank": 0} and res.received_bytes == 0
    want = _state(7)
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])


def test_a_save_removes_only_older_steps_never_one_a_faster_rank_has_begun(tmp_path) -> None:
    """Two ranks of a node share its directory: the one that finishes step 7 later must not remove the
    step 8 the faster one is already writing (a loaded in-job restart test lost a rank to that race)."""
    mgr = _mgr(tmp_path)
    d = tmp_path / "shm" / "xirang-job" / "n1"
    mgr.save(5, _state(5), state={"step": 5}, rank_state={"rank": 0}, to_disk=False, to_memory=True)
    (d / "step_8").mkdir()
    (d / "step_8" / "rank_1.h5").write_bytes(b"being written")
    mgr.save(7, _state(7), state={"step": 7}, rank_state={"rank": 0}, to_disk=False, to_memory=True)
    assert sorted(p.name for p in d.iterdir()) == ["step_7", "step_8"]
    assert (d / "step_8" / "rank_1.h5").read_bytes() == b"being written"


def test_memory_older_than_the_filesystem_is_not_used(tmp_path) -> None:
    mgr = _mgr(tmp_path)
    mgr.save(5, _state(5), state={"step": 5}, to_disk=False, to_memory=True)
    mgr.save(9, _state(9), state={"step": 9})
    reason = mgr.load_memory(_zeros(), fs_step=9)
    assert isinstance(reason, str) and "older than the filesystem checkpoint (step 9)" in reason
    assert not list((tmp_path / "shm" / "xirang-job" / "n1").iterdir())  # the stale copy is dropped


@pytest.mark.parametrize("victim", ["rank_0.h5", "state.json", "metadata.json"])
def test_a_memory_copy_that_fails_its_checksum_falls_back_with_the_file_named(tmp_path, victim: str) -> None:
    mgr = _mgr(tmp_path)
    mgr.save(5, _state(5), state={"step": 5}, rank_state={"rank": 0}, to_memory=True)
    f = tmp_path / "shm" / "xirang-job" / "n1" / "step_5" / victim
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    reason = mgr.load_memory(_zeros(), fs_step=5)
    assert isinstance(reason, str) and victim in reason and "checksum" in reason
    got = _zeros()
    assert mgr.load(got).step == 5 and torch.equal(got["model"]["w"], _state(5)["model"]["w"])


class _FreshTrainer:
    """What the checkpoint hook reads of a trainer at fit start: a model, its AdamW, a log, the phase."""

    def __init__(self, run_dir) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.run_dir, self.metrics_path = run_dir, run_dir / "metrics.jsonl"
        self.lines: list[str] = []

    def log(self, msg: str) -> None:
        self.lines.append(msg)

    def phase(self, phase: str) -> None:
        """The loop's phase announcement (the hook announces its restore): nothing to record here."""


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_fresh_start_takes_no_optimizer_step(tmp_path, in_memory: bool) -> None:
    """Nothing to restore (no checkpoint on disk or in memory): the hook leaves the optimizer untouched.

    Building the restore template initialises the optimizer's state by a zero-gradient step (AdamW's
    step counter then reads 1), so a fresh start with ``checkpoint.in_memory`` would train another run.
    """
    from xirang_hpc.checkpoint.trainer_hook import CheckpointHook
    from xirang_hpc.config.schema import XirangConfig
    from xirang_hpc.runtime.topology import Topology

    cfg = XirangConfig()
    cfg.checkpoint.in_memory = in_memory
    cfg.checkpoint.memory_dir = str(tmp_path / "shm")
    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="n1", master_addr="127.0.0.1", master_port=0, job_id="local", source="single")
    trainer = _FreshTrainer(tmp_path / "run")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    hook = CheckpointHook(cfg, topo, tmp_path / "run")
    hook.on_fit_start(trainer)
    assert (hook.memory is not None) == in_memory
    assert hook.last_saved == 0
    assert not trainer.opt.state, f"optimizer state was initialised on a fresh start: {trainer.opt.state}"
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("on_no_valid", ["refuse", "fresh"])
def test_no_usable_checkpoint_refuses_or_starts_fresh_on_purpose(tmp_path, on_no_valid: str) -> None:
    """The run's only checkpoint is damaged: by default the start is refused, naming it; with
    ``checkpoint.on_no_valid=fresh`` it starts from the untouched fresh init (optimizer state empty too)."""
    from xirang_hpc.checkpoint import layout as ckpt_layout
    from xirang_hpc.checkpoint.trainer_hook import CheckpointHook
    from xirang_hpc.config.schema import XirangConfig
    from xirang_hpc.runtime.topology import Topology

    cfg = XirangConfig()
    cfg.checkpoint.on_no_valid = on_no_valid
    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="n1", master_addr="127.0.0.1", master_port=0, job_id="local", source="single")
    run = tmp_path / "run"
    CheckpointManager(run / "checkpoints", async_save=False).save(3, {"model": {"weight": torch.ones(3, 4)}})
    shard = run / "checkpoints" / "step_3" / "rank_0.h5"
    shard.write_bytes(shard.read_bytes()[:-100])
    trainer = _FreshTrainer(run)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    from xirang_hpc.monitor.events import EventLog

    hook = CheckpointHook(cfg, topo, run, events=EventLog(run))
    if on_no_valid == "refuse":
        with pytest.raises(ckpt_layout.CheckpointCorruptError,
                           match=r"no checkpoint under .*checkpoints is usable \(step 3: .*rank_0.h5: size.*"
                                 r"checkpoint.on_no_valid=fresh"):
            hook.on_fit_start(trainer)
    else:
        hook.on_fit_start(trainer)
        assert not trainer.opt.state
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert any(e["kind"] == "fresh_start" and e["skipped"] == [3] for e in events)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
