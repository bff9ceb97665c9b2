"""Exact resume through the real job function on 4 gloo ranks, and resume_from forking.

20 steps uninterrupted vs 10 steps (stopped at a step boundary, as a preemption would) + resume
+ 10: the final weights and optimizer state are bitwise identical. Each run is 4 real processes
with submitit's local-executor environment, calling ``xirang_hpc.job.training.run_training``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import compose_cfg
from ranks import rank_context, run_ranks

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.rollback import fork_run
from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata
from xirang_hpc.config.validate import load_config
from xirang_hpc.submit.rundir import make_private_dir

# The layout the reference and the interrupted run use (hybrid: dp2 x tp2 on 2 virtual nodes x 2 ranks,
# ZeRO-1: each dp rank saves the optimizer state of the tensor-parallel shards it owns).
SAVE_LAYOUT = ["parallel.tp=2", "parallel.pp=1", "parallel.microbatches=1", "parallel.zero=1"]
# A 2-rank save layout (pure dp2 on one virtual node), the source of the 2 -> 8 change.
TWO_RANKS = ["cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.tp=1", "parallel.pp=1",
             "parallel.microbatches=1"]
# Resume a step-10 checkpoint under another layout: (source run, ranks, overrides). "split" was saved
# under SAVE_LAYOUT on 4 ranks, "split2" under TWO_RANKS. Adding a change is one line.
RESHARD = {
    "zero1:dp2xtp2->dp2 (4->2 ranks)": ("split", 2, TWO_RANKS),
    "zero1:dp2xtp2->pp2xdp2": ("split", 4, ["parallel.tp=1", "parallel.pp=2", "parallel.microbatches=2"]),
    "zero1:dp2xtp2->zero2:pp2xdp2": ("split", 4, ["parallel.tp=1", "parallel.pp=2", "parallel.microbatches=2",
                                                  "parallel.zero=2"]),
    "zero1:dp2xtp2->dp4+zero1": ("split", 4, ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1",
                                              "parallel.zero=1"]),
    "zero1:dp2xtp2->fsdp4": ("split", 4, ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1",
                                          "parallel.data_parallel=fsdp"]),
    # 8 gloo ranks on a 2-core box: 1 intra-op thread each, every dimension used.
    "dp2->dp2xtp2xpp2 (2->8 ranks)": ("split2", 8, ["cluster.nodes=2", "cluster.tasks_per_node=4",
                                                   "cluster.threads_per_rank=1", "parallel.tp=2", "parallel.pp=2",
                                                   "parallel.microbatches=2"]),
}


def _rank_main(rank: int, world: int, job: str, cfg: dict, run_dir: str, data_dir: str, stop_at: int) -> None:
    os.environ.update(SUBMITIT_LOCAL_GLOBALID=str(rank), SUBMITIT_LOCAL_LOCALID=str(rank),
                      SUBMITIT_LOCAL_NTASKS=str(world), SUBMITIT_LOCAL_JOB_ID=job)
    from xirang_hpc.job import training as jobmod
    from xirang_hpc.runtime.hooks import TrainerHook

    if stop_at:
        class StopAt(TrainerHook):  # what a preemption signal does: stop at a step boundary
            def on_step_end(self, trainer, metrics):
                if trainer.state.step >= stop_at:
                    trainer.stop_requested = True

        real = jobmod.build_hooks
        jobmod.build_hooks = lambda *a: [*real(*a), StopAt()]
    jobmod.run_training(cfg, run_dir, data_dir)


def run_job(cfg: dict, run_dir: Path, data_dir: Path, world: int = 4, stop_at: int = 0) -> None:
    """Run the job function on ``world`` local ranks (spawned processes); fail if any rank fails."""
    make_private_dir(run_dir)  # as the launcher does before submitting
    ctx = rank_context()
    job = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, job, cfg, str(run_dir), str(data_dir), stop_at))
             for r in range(world)]
    codes = run_ranks(procs)
    assert codes == [0] * world, f"ranks exited with {codes}"


def make_cfg(data_dir: Path, run_dir: Path, extra: list[str]) -> dict:
    over = ["model=tiny", "cluster=local", "train.max_steps=20", "train.global_batch=8", "train.warmup_steps=2",
            "train.eval_batches=1", "train.log_every=5", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
            "monitor.enabled=false", f"data.out_dir={data_dir}", f"train.run_dir={run_dir}", *extra]
    return dataclasses.asdict(load_config(compose_cfg(over)))


def saved_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, as full (unsharded) tensors."""
    md = read_metadata(step_dir)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HDF5StorageReader(step_dir), no_dist=True)
    return sd


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_data) -> dict[str, Path]:
    """The uninterrupted 20-step run, and a run stopped at step 10 (plus forks of it for resharding)."""
    tmp = tmp_path_factory.mktemp("resume")
    full, split = tmp / "full", tmp / "split"
    run_job(make_cfg(stdlib_data, full, SAVE_LAYOUT), full, stdlib_data)
    run_job(make_cfg(stdlib_data, split, SAVE_LAYOUT), split, stdlib_data, stop_at=10)
    out = {"full": full, "split": split, "data": stdlib_data}
    if any(src == "split2" for src, _, _ in RESHARD.values()):
        out["split2"] = tmp / "split2"
        run_job(make_cfg(stdlib_data, out["split2"], TWO_RANKS), out["split2"], stdlib_data, world=2, stop_at=10)
    forks = {name: fork_run(out[src], 10, tmp / f"fork{i}") for i, (name, (src, _, _)) in enumerate(RESHARD.items())}
    return {**out, **forks}


@pytest.mark.slow
def test_exact_resume_20_vs_10_plus_10(runs):
    full, split = runs["full"], runs["split"]
    assert ckpt_layout.committed_steps(split / "checkpoints") == [10]
    run_job(make_cfg(runs["data"], split, SAVE_LAYOUT), split, runs["data"])
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and any(k.startswith("model.") for k in a)
    assert any(k.startswith("optim.state.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    # The model really trained between 10 and 20 (the comparison is not between untouched tensors).
    early = saved_tensors(full / "checkpoints" / "step_10")
    assert all(not torch.equal(a[k], early[k]) for k in a if k.startswith("model.") and "weight" in k)
    sa = ckpt_layout.read_state(full / "checkpoints" / "step_20")
    sb = ckpt_layout.read_state(split / "checkpoints" / "step_20")
    assert ckpt_layout.read_manifest(full / "checkpoints" / "step_20")["layout"]["dims"] == {"dp": 2, "tp": 2, "pp": 1}
    assert sa["step"] == sb["step"] == 20 and sa["tokens_seen"] == sb["tokens_seen"]
    assert sa["initial_val_loss"] == sb["initial_val_loss"]
    assert _losses(full) == _losses(split) and sorted(_losses(full)) == [5, 10, 15, 20]
    rng = [json.loads((split / "checkpoints" / "step_20" / f"rank_{r}.json").read_text()) for r in range(4)]
    assert [x["rank"] for x in rng] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("change", list(RESHARD))
def test_resharded_resume_continues_training(runs, change):
    """Step 10 saved under one layout, resumed under another: losses match the uninterrupted run."""
    src, world, over = RESHARD[change]
    fork = runs[change]
    run_job(make_cfg(runs["data"], fork, over), fork, runs["data"], world=world)
    ref, got = _losses(runs["full"]), _losses(fork)
    assert sorted(got) == [5, 10, 15, 20]
    for step in (15, 20):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), f"step {step}: {got[step]} vs {ref[step]}"
    m = ckpt_layout.read_manifest(fork / "checkpoints" / "step_20")
    saved = ckpt_layout.read_manifest(runs[src] / "checkpoints" / "step_10")
    assert m["world_size"] == world and math.prod(m["layout"]["dims"].values()) == world
    assert (m["world_size"], m["layout"]) != (saved["world_size"], saved["layout"])  # the layout really changed


@pytest.mark.slow
def test_resume_from_forks_a_new_run_through_the_job_function(runs):
    """train.resume_from=10 on a finished 20-step run: the job forks, trains 11..20 in the fork and
    reaches bitwise the same step 20; the original run's checkpoints and metrics are untouched."""
    full = runs["full"]
    before = {s: ckpt_layout.read_manifest(full / "checkpoints" / f"step_{s}")["committed_at"] for s in (10, 20)}
    metrics_before = (full / "metrics.jsonl").read_text()
    events_before = (full / "events.jsonl").read_text()
    run_job(make_cfg(runs["data"], full, [*SAVE_LAYOUT, "train.resume_from=10"]), full, runs["data"])
    fork = Path(json.loads((full / "forks.json").read_text())["10"])
    assert fork.parent == full.parent and fork.name.startswith(f"{full.name}-from10-")
    assert json.loads((fork / "forked_from.json").read_text())["step"] == 10
    ident = json.loads((fork / "identity.json").read_text())  # the fork records what it trains
    assert ident["fork_step"] == 10 and ident["forked_from"] == str(full) and ident["model"]["d_model"] > 0
    assert ckpt_layout.committed_steps(fork / "checkpoints") == [10, 20]
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(fork / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(fork) == _losses(full)
    after = {s: ckpt_layout.read_manifest(full / "checkpoints" / f"step_{s}")["committed_at"] for s in (10, 20)}
    assert after == before and (full / "metrics.jsonl").read_text() == metrics_before
    # Every hook wrote where the run trains: the fork's events, none of them in the original's history.
    assert (full / "events.jsonl").read_text() == events_before
    kinds = [json.loads(x)["kind"] for x in (fork / "events.jsonl").read_text().splitlines() if x.strip()]
    assert kinds.count("checkpoint") == 1 and (fork / "environment.json").exists()


@pytest.mark.slow
def test_in_memory_checkpoints_do_not_change_an_uninterrupted_run(runs, tmp_path):
    """``checkpoint.in_memory=true`` with no fault: bitwise the run without it (weights, optimizer state,
    AdamW's step counter, losses), with the memory copies really made. Plain dp4 with a full AdamW on every
    rank, whose state a restore template would initialise by a step (ZeRO-1 initialises its own by hand)."""
    layout = ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", "parallel.zero=0"]
    ref, mem = tmp_path / "ref", tmp_path / "mem"
    run_job(make_cfg(runs["data"], ref, layout), ref, runs["data"])
    run_job(make_cfg(runs["data"], mem, [*layout, "checkpoint.in_memory=true",
                                         f"checkpoint.memory_dir={tmp_path / 'shm'}"]), mem, runs["data"])
    events = [json.loads(x) for x in (mem / "events.jsonl").read_text().splitlines() if x.strip()]
    assert [e["step"] for e in events if e["kind"] == "memory_checkpoint"] == [10, 20]
    a, b = saved_tensors(ref / "checkpoints" / "step_20"), saved_tensors(mem / "checkpoints" / "step_20")
    assert a.keys() == b.keys()
    steps = [k for k in a if k.startswith("optim.state.") and k.endswith(".step")]
    assert steps and all(float(b[k]) == 20 for k in steps), {k: float(b[k]) for k in steps}
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs with checkpoint.in_memory=true"
    assert _losses(ref) == _losses(mem)


def test_metrics_history_reads_each_row_once_and_follows_a_rewrite(tmp_path) -> None:
    """A save records the run's metrics; each save reads only the rows appended since the previous one (not
    the whole file again), skips a row still being written, and starts over on a file rewritten shorter."""
    import json

    from xirang_hpc.checkpoint.state import MetricsHistory

    path = tmp_path / "metrics.jsonl"
    h = MetricsHistory()
    assert h.read(path) == []
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(3)))
    assert [r["step"] for r in h.read(path)] == [0, 1, 2]
    with path.open("a") as f:
        f.write(json.dumps({"step": 3}) + "\n" + '{"step": 4')  # the last row not yet complete
    assert [r["step"] for r in h.read(path)] == [0, 1, 2, 3]
    read_from = h.offset
    with path.open("a") as f:
        f.write("}\n")
    assert [r["step"] for r in h.read(path)] == [0, 1, 2, 3, 4] and h.offset > read_from
    path.write_text(json.dumps({"step": 0}) + "\n")  # a rollback rewrites the file shorter
    assert [r["step"] for r in h.read(path)] == [0]


#: A mixture-of-experts tiny model (4 experts, top 2, every block) for the MoE resume runs.
MOE_MODEL = ["model.norm=rmsnorm", "model.mlp=swiglu", "model.pos=rope", "model.bias=false", "model.moe_experts=4",
             "model.moe_top_k=2", "model.moe_ffn_hidden=32"]


@pytest.mark.slow
@pytest.mark.parametrize("balance,layout", [("bias", "fsdp"), ("aux_loss", "ddp")])
def test_moe_exact_resume_20_vs_10_plus_10(stdlib_data, tmp_path, balance, layout):
    """An MoE run on 2 ranks, stopped at step 10 and resumed, ends bitwise where the uninterrupted one does:
    experts, router, optimizer state and (bias balancing) the expert-selection bias, which is checkpointed."""
    extra = [*TWO_RANKS, *MOE_MODEL, f"model.moe_balance={balance}", f"parallel.data_parallel={layout}"]
    full, split = tmp_path / "full", tmp_path / "split"
    run_job(make_cfg(stdlib_data, full, extra), full, stdlib_data, world=2)
    run_job(make_cfg(stdlib_data, split, extra), split, stdlib_data, world=2, stop_at=10)
    assert ckpt_layout.committed_steps(split / "checkpoints") == [10]
    run_job(make_cfg(stdlib_data, split, extra), split, stdlib_data, world=2)
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and "model.layers.0.mlp.w1" in a and "model.layers.1.mlp.gate.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    bias = [k for k in a if k.endswith("mlp.expert_bias")]
    experts = [k for k in a if k.startswith("model.") and k.endswith("mlp.w1")]  # one per block (model=tiny: 4)
    assert len(experts) == 4 and len(bias) == (len(experts) if balance == "bias" else 0)
    early = saved_tensors(full / "checkpoints" / "step_10")
    for k in ("model.layers.0.mlp.w1", "model.layers.0.mlp.gate.weight", *bias):
        assert not torch.equal(a[k], early[k]), f"{k} did not change between steps 10 and 20"
    assert _losses(full) == _losses(split) and sorted(_losses(full)) == [5, 10, 15, 20]


def _assert_continues_to_rounding(full: Path, fork: Path, final: dict[str, torch.Tensor]) -> None:
    """A step-10 checkpoint resumed under another expert layout (``fork``) continues like the uninterrupted run
    (``full``, whose step-20 tensors are ``final``) to fp32 rounding: losses at 15 and 20 within rel 1e-5 (step 10
    is the checkpoint's own record), the experts' weights within 1e-5, and trained after the reshard."""
    ref, got = _losses(full), _losses(fork)
    assert sorted(got) == [5, 10, 15, 20] and got[10] == ref[10]
    for step in (15, 20):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), f"step {step}: {got[step]} vs {ref[step]}"
    c = saved_tensors(fork / "checkpoints" / "step_20")
    early = saved_tensors(full / "checkpoints" / "step_10")
    for k in (k for k in final if k.startswith("model.") and k.endswith("mlp.w1")):
        torch.testing.assert_close(c[k], final[k], rtol=0, atol=1e-5)
        assert not torch.equal(c[k], early[k]), f"{k} did not train after the reshard"


#: efsdp layouts: FSDP2 on 4 ranks, and HSDP on 8 (2 replicate groups of 4, each with 2 expert groups of 2)
EFSDP_LAYOUTS = {
    "fsdp": (4, ["cluster.nodes=2", "cluster.tasks_per_node=2"]),
    "hsdp": (8, ["cluster.nodes=2", "cluster.tasks_per_node=4", "parallel.dp_replicate=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(EFSDP_LAYOUTS))
def test_moe_efsdp_resume_and_reshard_to_ep2_ddp(stdlib_data, tmp_path, kind):
    """Experts sharded over ep=2 and, by FSDP2, over the 2 expert groups of a shard group too (efsdp: ep2 x fsdp
    on 4 ranks; ep2 under HSDP on 8, replicated over its 2 replicate groups): each rank saves a quarter of the
    experts and of their optimizer state, as shards of the full tensors.

    - stopped at step 10 and resumed under the same layout, it ends bitwise where the uninterrupted run does;
    - the checkpoint holds the full (E, ...) expert weights and AdamW moments;
    - the same step-10 checkpoint resumed on 2 ranks at ep2 under DDP (experts E/2 a rank, no edp) continues
      like the uninterrupted run to fp32 rounding (another reduction order, so not bitwise).
    """
    world, ranks = EFSDP_LAYOUTS[kind]
    efsdp = [*ranks, "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", *MOE_MODEL, "parallel.ep=2",
             "parallel.data_parallel=fsdp"]
    full, split = tmp_path / "full", tmp_path / "split"
    run_job(make_cfg(stdlib_data, full, efsdp), full, stdlib_data, world=world)
    run_job(make_cfg(stdlib_data, split, efsdp), split, stdlib_data, world=world, stop_at=10)
    saved = saved_tensors(split / "checkpoints" / "step_10")
    w1 = saved["model.layers.0.mlp.w1"]
    assert w1.shape[0] == 4 and all(w1[e].abs().sum() > 0 for e in range(4)), "every expert saved, whatever the layout"
    moments = [saved[f"optim.state.layers.0.mlp.w1.{m}"] for m in ("exp_avg", "exp_avg_sq")]
    assert all(v.shape == w1.shape and all(v[e].abs().sum() > 0 for e in range(4)) for v in moments)
    fork = fork_run(split, 10, tmp_path / "fork")
    run_job(make_cfg(stdlib_data, split, efsdp), split, stdlib_data, world=world)
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and "model.layers.0.mlp.w1" in a
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after an efsdp resume"
    assert _losses(full) == _losses(split)

    run_job(make_cfg(stdlib_data, fork, [*TWO_RANKS, *MOE_MODEL, "parallel.ep=2"]), fork, stdlib_data, world=2)
    assert ckpt_layout.read_manifest(fork / "checkpoints" / "step_20")["layout"]["parallel"]["data_parallel"] == "ddp"
    _assert_continues_to_rounding(full, fork, a)


@pytest.mark.slow
def test_moe_expert_parallel_resume_and_reshard_across_ep(stdlib_data, tmp_path):
    """Expert-parallel checkpoints (each rank saves its experts as shards of the full tensors):

    - ep2 stopped at step 10 and resumed at ep2 ends bitwise where the uninterrupted ep2 run does;
    - the same step-10 checkpoint resumed at ep1 (each rank loads all experts) ends bitwise there too: with
      ``parallel.ep_bitwise`` the expert ranks run each source rank's rows through GEMMs of their own and add
      the sources' gradients as the data-parallel all-reduce of ep1 adds them (models/moe.py
      ``_GroupedSwiGLU``).
    """
    ep2 = [*TWO_RANKS, *MOE_MODEL, "parallel.ep=2", "parallel.ep_bitwise=true"]
    full, split = tmp_path / "full", tmp_path / "split"
    run_job(make_cfg(stdlib_data, full, ep2), full, stdlib_data, world=2)
    run_job(make_cfg(stdlib_data, split, ep2), split, stdlib_data, world=2, stop_at=10)
    saved = saved_tensors(split / "checkpoints" / "step_10")
    assert saved["model.layers.0.mlp.w1"].shape[0] == 4, "the checkpoint holds every expert, whatever the ep"
    fork = fork_run(split, 10, tmp_path / "fork")
    run_job(make_cfg(stdlib_data, split, ep2), split, stdlib_data, world=2)
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and "model.layers.0.mlp.w1" in a and any(k.startswith("optim.state.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after an ep2 resume"
    assert _losses(full) == _losses(split)

    run_job(make_cfg(stdlib_data, fork, [*TWO_RANKS, *MOE_MODEL, "parallel.ep=1"]), fork, stdlib_data, world=2)
    m = ckpt_layout.read_manifest(fork / "checkpoints" / "step_20")
    assert m["layout"]["parallel"]["ep"] == 1
    assert ckpt_layout.read_manifest(split / "checkpoints" / "step_10")["layout"]["parallel"]["ep"] == 2
    _assert_bitwise(a, fork)
    assert _losses(full) == _losses(fork)


def _assert_bitwise(final: dict[str, torch.Tensor], fork: Path) -> None:
    """``fork``'s step-20 checkpoint holds bitwise the tensors ``final`` (weights, AdamW moments, bias)."""
    c = saved_tensors(fork / "checkpoints" / "step_20")
    assert c.keys() == final.keys()
    differ = [k for k in final if not torch.equal(final[k], c[k])]
    assert not differ, f"differ from the uninterrupted run: {differ}"


@pytest.mark.slow
@pytest.mark.parametrize("dp,changes", [("ddp", (2, 1)), ("fsdp", (2,))])
def test_moe_resume_across_ep_on_4_ranks_is_bitwise(stdlib_data, tmp_path, dp, changes):
    """ep4 on 4 ranks (2 virtual nodes x 2) stopped at step 10 and resumed at ep2 (and, under DDP, ep1) ends
    bitwise where the uninterrupted ep4 run does (``parallel.ep_bitwise``): every source rank's rows meet the
    same GEMMs whatever ep, and
    an expert's gradient adds the 4 ranks' contributions as ((r0 + r1) + (r2 + r3)) in every layout (the
    expert rank's pairwise sum, the 2-rank edp all-reduce, the hierarchical data-parallel all-reduce; under
    FSDP2 at ep2 the efsdp reduce-scatter over 2). One microbatch a step: accumulation would add the
    microbatches before the ranks at ep1 and after them at ep4. Without ``ep_bitwise``: fp32 rounding."""
    layout = ["cluster.nodes=2", "cluster.tasks_per_node=2", "parallel.tp=1", "parallel.pp=1",
              "parallel.microbatches=1", f"parallel.data_parallel={dp}", *MOE_MODEL]
    full = tmp_path / "full"
    run_job(make_cfg(stdlib_data, full, [*layout, "parallel.ep=4", "parallel.ep_bitwise=true"]), full, stdlib_data,
            world=4)
    final = saved_tensors(full / "checkpoints" / "step_20")
    assert final["model.layers.0.mlp.w1"].shape[0] == 4
    for ep in changes:
        fork = fork_run(full, 10, tmp_path / f"ep{ep}")
        bitwise = ["parallel.ep_bitwise=true"] if ep > 1 else []  # at ep=1 every rank runs its own rows anyway
        run_job(make_cfg(stdlib_data, fork, [*layout, f"parallel.ep={ep}", *bitwise]), fork, stdlib_data, world=4)
        assert ckpt_layout.read_manifest(fork / "checkpoints" / "step_20")["layout"]["parallel"]["ep"] == ep
        _assert_bitwise(final, fork)
        assert _losses(fork) == _losses(full)
    # Without ep_bitwise the expert ranks run all sources' rows on one GEMM chain: to fp32 rounding only.
    fork = fork_run(full, 10, tmp_path / "ep2-grouped")
    run_job(make_cfg(stdlib_data, fork, [*layout, "parallel.ep=2"]), fork, stdlib_data, world=4)
    _assert_continues_to_rounding(full, fork, final)
    c = saved_tensors(fork / "checkpoints" / "step_20")
    assert any(not torch.equal(final[k], c[k]) for k in final), "bitwise without parallel.ep_bitwise"
