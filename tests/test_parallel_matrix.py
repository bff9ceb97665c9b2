"""Every parallel layout trains exactly like one process (fp32, CPU, real gloo groups).

For each world size one group of real processes is spawned and runs all its layouts, each with
recompute none and full (selective once). For every layout, against the single-process run of
the same model, data and seed:
- each of the first 10 step losses within rtol 1e-5 (and every rank reports the same loss);
- the global gradient norm of every step within rtol 1e-5. Clipping is active at every step
  (clip 0.05, norms ~2-6), so a norm that double-counts replicated tensor-parallel weights or
  misses other pipeline stages' gradients (the classic Megatron bug) changes the update and
  fails both this check and the parameter check;
- the final parameters (gathered from DTensor shards and pipeline stages) within atol 1e-5.

Chat data (``data.format=chat``: masked targets, the loss a mean over the global batch's learned tokens),
packed (per-sample positions, block-diagonal attention carried through every pipeline stage) and padded,
under DDP, TP, FSDP2 (ZeRO-2 with accumulation, ZeRO-3), 1F1B and interleaved pipelines, dp x pp.

ZeRO stages (``parallel.zero``) x TP x PP, chosen to prove each composition once within CI time:
ZeRO-1 x DDP (dp2zero), x TP (zero1dp2xtp2), x PP (zero1dp2xpp2), x TP x PP (zero1dp2xtp2xpp2);
ZeRO-2 with accumulation (zero2dp2: a reduce-scatter per microbatch), x TP (zero2dp2xtp2), x PP
(zero2dp2xpp2); ZeRO-3 (fsdp4, hsdp2x2, zero3dp2 with accumulation), x TP (fsdp2xtp2), x PP
(zero3dp2xpp2), x TP x PP (zero3dp2xtp2xpp2). Each also shows its sharding: ZeRO-1 keeps AdamW state for part of the
rank's (replicated) parameters only, ZeRO-2/3 hold parameter shards.

Context parallelism (``parallel.cp``: every row split over the cp ranks in load-balanced chunks, K/V
all-gathered): cp2 (learned positions; with recompute full; with accumulation), cp2 x dp2 (DDP over dp x cp),
cp2 x tp2, fsdp2 x cp2 (FSDP2 sharding over dp_shard x cp), grouped-query RoPE (cp2, cp2 x tp2), the chunked
loss, and chat rows packed (per-sample positions and the block-diagonal mask across shards) and padded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import parallel_harness as H
import pytest

GROUPS = {
    2: [("dp2", "none"), ("dp2", "full"), ("tp2", "none"), ("tp2", "full"), ("tp2", "selective"),
        ("pp2", "none"), ("pp2", "full"), ("tp2sp", "none"), ("dp2zero", "none"), ("pp2v2", "none"),
        ("pp2v2", "full"), ("zero2dp2", "none"), ("zero3dp2", "none"), ("cp2", "none"), ("cp2", "full"),
        ("cp2", "selective"), ("cp2acc", "none")],
    4: [(n, r) for n in ("dp2xtp2", "dp2xpp2", "tp2xpp2", "fsdp4", "fsdp2xtp2", "hsdp2x2") for r in ("none", "full")]
    + [("dp2xpp2v2", "none")]
    + [(n, "none") for n in ("zero1dp2xtp2", "zero1dp2xpp2", "zero2dp2xtp2", "zero2dp2xpp2", "zero3dp2xpp2")]
    + [(n, "none") for n in ("cp2xdp2", "cp2xtp2", "fsdp2xcp2")],
    8: [("dp2xtp2xpp2", "none"), ("dp2xtp2xpp2", "full"), ("zero1dp2xtp2xpp2", "none"),
        ("zero3dp2xtp2xpp2", "none")],
}
CASES = [(w, n, r) for w, jobs in GROUPS.items() for n, r in jobs]
# Not exact-vs-fp32 cases, run in the same process groups: name -> (world, layout, train overrides).
EXTRA = {"pp2/bf16": (2, "pp2", {"precision": "bf16"}), "zero3dp2/bf16": (2, "zero3dp2", {"precision": "bf16"})}
# Other model shapes, each against its own single-process reference, in the same process groups:
# grouped-query attention (Llama family: 4 query heads sharing 2 key/value heads, TP shards the kv
# heads) and tied input/output embeddings (GPT-2 family).
GQA = {"name": "gqa", "n_kv_head": 2, "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False,
       "rope_theta": 500000.0}
TIED = {"name": "tied", "tie_embeddings": True}
UNEVEN = {"name": "uneven", "n_layer": 5}  # pipeline stages that do not divide the layers
MODELS = {"gqa": GQA, "tied": TIED, "uneven": UNEVEN}
# The chunked head + loss (train.loss_chunk_tokens; 24 tokens: chunks cross sequence rows) against the plain
# single-process reference: inside the forward under DDP and FSDP2 (ZeRO-2 and -3), in the last pipeline stage
# (1F1B and interleaved), beside tensor parallelism.
CHUNKED = [(2, "dp2"), (2, "tp2"), (2, "pp2"), (2, "pp2v2"), (2, "zero2dp2"), (4, "fsdp4"), (4, "dp2xpp2"),
           (4, "fsdp2xtp2"), (2, "cp2")]
# LoRA (frozen base, adapters on every block linear) against the single-process LoRA run, in process groups
# of their own: data parallel (DDP), FSDP2 (ZeRO-3), pipeline stages (1F1B), both together.
# train.compile (each block through torch.compile, Inductor on the CPU) against the eager single-process reference,
# in the world-2 group: DDP, FSDP2 (ZeRO-3), tensor parallel, 1F1B pipeline stages, and over full recompute.
# ~10 s of compiling per case here on a cold cache (the per-user cache makes a rerun cheaper; no timing is tested).
COMPILED = [(2, "dp2", "none"), (2, "zero3dp2", "none"), (2, "tp2", "none"), (2, "pp2", "none"), (2, "dp2", "full")]
# The compiled loss (train.compile compiles the loss too): the chunked head's compiled per-chunk step inside the
# forward under FSDP2 (ZeRO-3) and in the last pipeline stage; the compiled plain loss runs in every case above.
COMPILED_CHUNKED = [(2, "zero3dp2"), (2, "pp2")]
# train.optimizer_impl beside the default AdamW: over FSDP2's DTensor shards, tensor parallelism's mix of DTensor
# and plain parameters, and ZeRO-1's local AdamW (cheap: no compiling).
OPTIMIZER_CASES = [(2, "zero3dp2", "fused"), (2, "tp2", "fused"), (2, "tp2", "foreach"), (2, "dp2zero", "fused")]
LORA_CASES = [(2, "dp2"), (2, "pp2"), (2, "tp2"), (4, "fsdp4"), (4, "dp2xpp2"), (4, "dp2xtp2")]
# Chat fine-tuning data (a BPE of 512 tokens, seq_len 64) against the single-process run of the same data:
# packed rows in every layout kind, padded rows and the chunked loss under DDP.
CHAT_MODEL = {"name": "chat", "vocab_size": 512, "seq_len": 64, "pos": "rope"}
CHAT_CASES = [(2, "dp2", "packed"), (2, "tp2", "packed"), (2, "pp2", "packed"), (2, "pp2v2", "packed"),
              (2, "zero2dp2", "packed"), (2, "dp2", "padded"), (2, "dp2", "chunked"), (4, "dp2xpp2", "packed"),
              (4, "fsdp4", "packed"), (2, "cp2", "packed"), (2, "cp2", "padded"), (4, "cp2xdp2", "packed")]
SHAPE_CASES = [(4, "dp2xtp2", "gqa"), (4, "tp2xpp2", "gqa"), (4, "fsdp2xtp2", "gqa"), (4, "dp2xpp2v2", "gqa"),
               (4, "dp2xtp2", "tied"), (4, "fsdp4", "tied"), (2, "tp2sp", "gqa"), (4, "dp2xpp2", "uneven"),
               (2, "pp2v2", "uneven"), (2, "cp2", "gqa"), (4, "cp2xtp2", "gqa")]


# Mixture-of-experts (H.MOE: 4 experts, top-2) against the single-process MoE run, in process groups of their own:
# plain data parallelism (the auxiliary loss's statistics summed over the dp ranks), expert parallelism alone
# (ep2, ep4), beside replicas (ep2xdp2: DDP over 4, experts on 2), beside FSDP2 (ep2xfsdp2: the experts sharded
# over edp=2 too, efsdp; also with full recompute, ZeRO-2 over 2 accumulation steps, beside tp2 and in pp2
# stages; ep2xfsdp4: over edp=4 with 2 experts per group, each expert split on dim 1) and HSDP (ep2xhsdp2x2:
# experts replicated over the 2 replicate groups; ep2xhsdp2x4: also sharded over the 2 expert groups of each
# shard group, efsdp); with the auxiliary loss and with expert-bias balancing, and with full recompute;
# pipeline stages (1F1B and interleaved, 2 microbatches) with expert-bias balancing, alone and beside expert
# parallelism (each stage's loads summed over its dp ranks); tensor parallelism of the attention (experts whole
# on every tp rank), with sequence parallelism and beside expert parallelism; context parallelism (each cp rank
# routes its sequence shard's tokens, the balancing statistics summed over dp x cp). Accumulation is tested with
# bias balancing only: the auxiliary loss of each microbatch is not the whole batch's (a product of two batch
# means), as in one process.
MOE_BIAS = {**H.MOE, "name": "moe-bias", "moe_balance": "bias", "moe_bias_rate": 0.01}
MOE_CASES = [(2, "dp2", "aux"), (2, "ep2", "aux"), (4, "ep4", "aux"), (4, "ep2xdp2", "aux"), (4, "ep2xfsdp2", "aux"),
             (4, "ep2xhsdp2x2", "aux"), (2, "ep2", "bias"), (4, "ep2xdp2", "bias"), (4, "ep2xfsdp2", "bias"),
             (2, "ep2", "aux+full"), (2, "ep2", "bias+full"), (4, "ep2xfsdp2", "aux+full"),
             (4, "ep2xzero2x2", "bias"), (2, "pp2", "bias"), (2, "pp2v2", "bias"), (4, "ep2xpp2", "bias"),
             (2, "tp2", "aux"), (2, "tp2sp", "bias"), (4, "ep2xtp2", "aux"), (4, "ep2xtp2", "bias"), (2, "cp2", "aux"),
             (2, "cp2", "bias"), (4, "cp2xdp2", "aux"), (8, "ep2xfsdp2xtp2", "aux"),
             (8, "ep2xfsdp2xpp2", "bias"), (8, "ep2xfsdp4", "aux"), (8, "ep2xhsdp2x4", "aux"),
             # train.compile: each MoE block's attention half and router compiled, the dispatch and experts eager
             (2, "dp2", "aux+compiled"), (2, "ep2", "bias+compiled"), (2, "ep2", "aux+full+compiled"),
             (2, "pp2", "bias+compiled"), (2, "tp2", "aux+compiled"), (4, "ep2xfsdp2", "aux+compiled")]
# "+full" / "+selective": with that recompute (the all-to-alls run again in backward); "+compiled": train.compile
MOE_MODELS = {"aux": H.MOE, "bias": MOE_BIAS}


def _moe_cfg(world: int, layout: str, kind: str):
    balance, *more = kind.split("+")
    recompute = next((r for r in more if r in ("full", "selective")), "none")
    train = {"compile": True} if "compiled" in more else None
    return H.with_recompute(H.make_cfg(world, H.LAYOUTS[layout], model=MOE_MODELS[balance], train=train), recompute)


@pytest.fixture(scope="module")
def ref(email_data: Path) -> dict:
    r = H.reference(email_data)
    assert min(r["norms"]) > 0.05, "clipping must be active for the grad-norm check to bite"
    return r


def _groups_per_world(jobs_for: Callable[[int], list], data: Path) -> Callable[[int], dict]:
    """For a module-scoped fixture: ``world -> {job name: per-rank results}``, each world size's jobs
    (``jobs_for(world)``: name, config) run in one group of ``world`` real processes on first use, then kept."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = H.run_group(world, jobs_for(world), data, steps=10, timeout_s=420)
        return cache[world]

    return get


def _matrix_jobs(world: int) -> list:
    jobs = [(f"{n}/{r}", H.with_recompute(H.make_cfg(world, H.LAYOUTS[n]), r)) for n, r in GROUPS[world]]
    jobs += [(k, H.make_cfg(w, H.LAYOUTS[n], train=tr)) for k, (w, n, tr) in EXTRA.items() if w == world]
    jobs += [(f"{n}/{m}", H.make_cfg(w, H.LAYOUTS[n], model=MODELS[m])) for w, n, m in SHAPE_CASES if w == world]
    jobs += [(f"{n}/chunked", H.make_cfg(w, H.LAYOUTS[n], train={"loss_chunk_tokens": 24}))
             for w, n in CHUNKED if w == world]
    jobs += [(f"{n}/{r}/compiled", H.with_recompute(H.make_cfg(w, H.LAYOUTS[n], train={"compile": True}), r))
             for w, n, r in COMPILED if w == world]
    jobs += [(f"{n}/chunked/compiled", H.make_cfg(w, H.LAYOUTS[n], train={"compile": True, "loss_chunk_tokens": 24}))
             for w, n in COMPILED_CHUNKED if w == world]
    jobs += [(f"{n}/{o}", H.make_cfg(w, H.LAYOUTS[n], train={"optimizer_impl": o}))
             for w, n, o in OPTIMIZER_CASES if w == world]
    return jobs


@pytest.fixture(scope="module")
def groups(email_data: Path):
    return _groups_per_world(_matrix_jobs, email_data)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,recompute", CASES, ids=[f"{n}-{r}" for _, n, r in CASES])
def test_layout_matches_single_process(world: int, layout: str, recompute: str, groups, ref: dict) -> None:
    per_rank = groups(world)[f"{layout}/{recompute}"]
    assert len(per_rank) == world and all(per_rank), "every rank reports"
    for r in per_rank:  # the global loss is known on every rank, not only on the last stage
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(r["val"], ref["val"], rtol=1e-5, atol=0)  # eval after the 10 steps
    params = H.merged_params(per_rank)
    assert sorted(params) == sorted(ref["params"]), "stages together hold every parameter, under full names"
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)
    total = sum(v.size for v in ref["params"].values())
    cp = H.LAYOUTS[layout].get("cp", 1)
    assert all(r["seq_tokens"] == 16 // cp for r in per_rank), "each cp rank holds its shard of every row"
    if "tp" in layout or "fsdp" in layout or "pp" in layout:
        assert per_rank[0]["n_local_params"] < total, "rank 0 holds a share"
    lay = H.LAYOUTS[layout]
    zero, dp, rep = H.make_cfg(world, lay).parallel.zero, lay.get("dp", 1), lay.get("dp_replicate", 1)
    held, state = sum(r["n_local_params"] for r in per_rank), sum(r["n_opt_state"] for r in per_rank)
    if zero == 1:  # weights replicated over dp; each dp rank keeps AdamW state for its part of them only
        assert all(0 < r["n_opt_state"] < r["n_local_params"] for r in per_rank)
        assert state * dp == held, "each parameter's state is kept exactly once per dp group"
    elif zero >= 2:  # weights, and so their state, are dp shards (also after evaluation); replicated: >= dp*total
        assert all(r["n_opt_state"] == r["n_local_params"] for r in per_rank)
        assert held < 1.5 * total * rep < dp * total, (held, total)  # HSDP: one full copy per replicate group


def _assert_same_curves(per_rank: list[dict], world: int, ref: dict) -> None:
    """Every rank reported, and each one's losses, gradient norms and validation losses are the reference's."""
    assert len(per_rank) == world and all(per_rank), "every rank reports"
    for r in per_rank:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(r["val"], ref["val"], rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", CHUNKED, ids=[n for _, n in CHUNKED])
def test_chunked_loss_layout_matches_single_process(world: int, layout: str, groups, ref: dict) -> None:
    """The head and loss a chunk of tokens at a time: the plain single process's losses, norms and weights."""
    per_rank = groups(world)[f"{layout}/chunked"]
    _assert_same_curves(per_rank, world, ref)
    params = H.merged_params(per_rank)
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,model", SHAPE_CASES, ids=[f"{m}-{n}" for _, n, m in SHAPE_CASES])
def test_model_shape_layout_matches_single_process(world: int, layout: str, model: str, groups,
                                                   email_data: Path) -> None:
    """Grouped-query attention and tied embeddings train like one process in every layout kind."""
    ref = H.reference(email_data, model=MODELS[model])
    per_rank = groups(world)[f"{layout}/{model}"]
    assert len(per_rank) == world and all(per_rank), "every rank reports"
    for r in per_rank:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5, atol=0)
    params = H.merged_params(per_rank)
    assert sorted(params) == sorted(ref["params"])
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)
    if model == "gqa":  # k/v project to n_kv_head heads only
        assert ref["params"]["layers.0.attn.k.weight"].shape == (2 * 8, 32)
    elif model == "uneven":
        assert len({k.split(".")[1] for k in params if k.startswith("layers.")}) == 5
    else:  # one parameter under two names: trained once, listed once
        assert "head.weight" not in params and "tok_emb.weight" in params


def _assert_bf16_like_single_process(per_rank: list[dict], ref: dict, email_data: Path) -> None:
    """A bf16 layout's run: the single-process bf16 run's numbers (losses and val rtol 2e-4, weights atol 1e-2),
    not the fp32 run's (``ref``)."""
    refb = H.reference(email_data, train={"precision": "bf16"})
    for r in per_rank:
        np.testing.assert_allclose(r["losses"], refb["losses"], rtol=2e-4, atol=0)
        np.testing.assert_allclose(r["val"], refb["val"], rtol=2e-4, atol=0)
        assert max(abs(a / b - 1) for a, b in zip(r["losses"], ref["losses"])) > 1e-6, "bf16 differs from fp32"
    params = H.merged_params(per_rank)
    for name, want in refb["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-2, err_msg=name)


@pytest.mark.slow
def test_bf16_pipeline_stages_run_under_autocast(groups, ref: dict, email_data: Path) -> None:
    """train.precision=bf16 through a 1F1B pipeline (training and eval): close to the single-process
    bf16 run, and not the fp32 numbers (so every stage really ran under autocast). CPU autocast bf16;
    the CUDA path (precision=auto under nccl) cannot run here (no GPU)."""
    _assert_bf16_like_single_process(groups(2)["pp2/bf16"], ref, email_data)


@pytest.mark.slow
def test_bf16_zero3_trains_as_the_single_process_in_bf16(groups, ref: dict, email_data: Path) -> None:
    """train.precision=bf16 under ZeRO-3, whose blocks FSDP2 gathers in bf16 and reduces in fp32 (what that keeps
    for the backward: tests/test_data_parallel.py): the single-process bf16 run's numbers within the tolerance the
    pipeline gets, and not the fp32 run's."""
    _assert_bf16_like_single_process(groups(2)["zero3dp2/bf16"], ref, email_data)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,recompute", COMPILED, ids=[f"{n}-{r}" for _, n, r in COMPILED])
def test_compiled_layout_matches_eager_single_process(world: int, layout: str, recompute: str, groups,
                                                      ref: dict) -> None:
    """train.compile: the compiled blocks train like the eager single process (rtol/atol 1e-5), and compiled
    graphs really ran on every rank (an eager fallback would not make any)."""
    per_rank = groups(world)[f"{layout}/{recompute}/compiled"]
    _assert_same_curves(per_rank, world, ref)
    assert all(r["graphs"] > 0 for r in per_rank), [r["graphs"] for r in per_rank]
    params = H.merged_params(per_rank)
    assert sorted(params) == sorted(ref["params"]), "compiling keeps the parameter names"
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", COMPILED_CHUNKED, ids=[n for _, n in COMPILED_CHUNKED])
def test_compiled_chunked_loss_layout_matches_eager_single_process(world: int, layout: str, groups,
                                                                   ref: dict) -> None:
    """train.compile with the chunked head + loss: the compiled per-chunk step trains like the eager plain loss."""
    per_rank = groups(world)[f"{layout}/chunked/compiled"]
    _assert_same_curves(per_rank, world, ref)
    assert all(r["graphs"] > 0 for r in per_rank), [r["graphs"] for r in per_rank]
    params = H.merged_params(per_rank)
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_eager_layouts_make_no_graphs(groups) -> None:
    """The graph count the compiled cases assert on is 0 without train.compile (so it can fail)."""
    assert all(r["graphs"] == 0 for r in groups(2)["dp2/none"])


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,impl", OPTIMIZER_CASES, ids=[f"{n}-{o}" for _, n, o in OPTIMIZER_CASES])
def test_optimizer_impl_layout_matches_single_process(world: int, layout: str, impl: str, groups, ref: dict) -> None:
    """train.optimizer_impl=foreach|fused: the default AdamW's curves and weights, with the kernel asked for."""
    per_rank = groups(world)[f"{layout}/{impl}"]
    _assert_same_curves(per_rank, world, ref)
    assert all(r["optimizer"][impl] is True for r in per_rank)
    params = H.merged_params(per_rank)
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def lora_groups(email_data: Path):
    return _groups_per_world(lambda world: [(f"{n}/lora", H.make_cfg(w, H.LAYOUTS[n], finetune=H.LORA))
                                            for w, n in LORA_CASES if w == world], email_data)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", LORA_CASES, ids=[n for _, n in LORA_CASES])
def test_lora_layout_matches_single_process(world: int, layout: str, lora_groups, email_data: Path) -> None:
    """LoRA trains the adapters only, like one process: losses, norms, adapters; the base stays as it started."""
    ref = H.reference(email_data, finetune=H.LORA)
    per_rank = lora_groups(world)[f"{layout}/lora"]
    _assert_same_curves(per_rank, world, ref)
    params = H.merged_params(per_rank)
    assert sorted(params) == sorted(ref["params"])
    start = H.run_layout(H.make_cfg(1, {}, finetune=H.LORA), H.topology(0, 1, 0), email_data, steps=0)["params"]
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)
        if ".lora_" not in name:  # frozen: bitwise as initialised
            np.testing.assert_array_equal(params[name], start[name], err_msg=name)
    assert any(not np.array_equal(ref["params"][n], start[n]) for n in ref["params"] if ".lora_B" in n)
    # AdamW state for the adapters only: 6 linears x (A, B) x 4 blocks of rank-4 factors, far below the model
    n_adapters = sum(v.size for n, v in ref["params"].items() if ".lora_" in n)
    assert ref["n_opt_state"] == n_adapters < sum(v.size for v in ref["params"].values()) / 5


def _chat_cfg(world: int, layout: str, kind: str):
    from xirang_hpc.config.schema import DataConfig

    train = {"loss_chunk_tokens": 24} if kind == "chunked" else {}
    return H.make_cfg(world, H.LAYOUTS[layout] if layout else {}, model=CHAT_MODEL, train=train,
                      data=DataConfig(format="chat", packing=kind != "padded"))


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic conversations (lognormal reply lengths), a BPE of 512 tokens, chat loss masks."""
    import json
    import random

    from xirang_hpc.data.prepare import prepare

    rng = random.Random(0)
    words = "the cat sat on a mat while dogs ran far away from home and never came back".split()
    d = tmp_path_factory.mktemp("chat-matrix")
    with (d / "chat.jsonl").open("w") as f:
        for _ in range(400):
            reply = max(1, int(rng.lognormvariate(1.5, 0.7)))
            msgs = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 6)))},
                    {"role": "assistant", "content": " ".join(rng.choices(words, k=reply))}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    prepare(str(d / "chat.jsonl"), d / "out", val_fraction=0.1, tokenizer="bpe", vocab_size=512, fmt="chat",
            progress=None)
    return d / "out"


@pytest.fixture(scope="module")
def chat_groups(chat_data: Path):
    return _groups_per_world(lambda world: [(f"{n}/{k}", _chat_cfg(w, n, k))
                                            for w, n, k in CHAT_CASES if w == world], chat_data)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,kind", CHAT_CASES, ids=[f"{n}-{k}" for _, n, k in CHAT_CASES])
def test_chat_layout_matches_single_process(world: int, layout: str, kind: str, chat_groups,
                                            chat_data: Path) -> None:
    """Chat data, packed or padded: the single process's losses, norms, validation loss and weights."""
    ref = H.run_layout(_chat_cfg(1, "", kind), H.topology(0, 1, 0), chat_data, steps=10)
    assert min(ref["norms"]) > 0.05, "clipping must be active for the grad-norm check to bite"
    per_rank = chat_groups(world)[f"{layout}/{kind}"]
    _assert_same_curves(per_rank, world, ref)
    params = H.merged_params(per_rank)
    assert sorted(params) == sorted(ref["params"])
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def moe_groups(email_data: Path):
    return _groups_per_world(lambda world: [(f"{n}/{b}", _moe_cfg(w, n, b))
                                            for w, n, b in MOE_CASES if w == world], email_data)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,balance", MOE_CASES, ids=[f"{n}-{b}" for _, n, b in MOE_CASES])
def test_moe_layout_matches_single_process(world: int, layout: str, balance: str, moe_groups,
                                           email_data: Path) -> None:
    """A mixture-of-experts model under data and expert parallelism trains like one process (rtol 1e-5), and
    each expert-parallel rank holds E/ep experts (DDP: everything else whole; FSDP2: less), E/(ep*edp) where
    FSDP2 shards them over the edp ranks too (efsdp)."""
    model = MOE_MODELS[balance.split("+")[0]]
    ref = H.reference(email_data, model=model)
    assert min(ref["norms"]) > 0.05, "clipping must be active for the grad-norm check to bite"
    per_rank = moe_groups(world)[f"{layout}/{balance}"]
    _assert_same_curves(per_rank, world, ref)
    params = H.merged_params(per_rank)
    assert sorted(params) == sorted(ref["params"]), "expert shards gathered under their full names"
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)
    par = H.make_cfg(world, H.LAYOUTS[layout], model=model).parallel  # resolved: data_parallel, zero
    ep = par.ep
    # Each rank's expert weights: E/ep experts, or under efsdp (FSDP2 or HSDP: dp_shard/ep expert groups in a shard
    # group) E/(ep*edp) of them with edp = dp_shard/ep, or (edp not dividing E/ep) E/ep experts split on dim 1
    # over edp; the other dims whole. HSDP replicates them over its replicate groups. Layouts without ep hold all E.
    e, edp = model["moe_experts"], par.dp // par.dp_replicate // ep
    efsdp = ep > 1 and edp > 1 and par.data_parallel == "fsdp"
    rows = e // (ep * edp) if efsdp else e // ep
    for r in per_rank:
        assert r["expert_shapes"], "each rank holds expert weights"
        for name, shape in r["expert_shapes"].items():
            full = ref["params"][name].shape
            if efsdp and (e // ep) % edp:
                assert shape == (e // ep, full[1] // edp, *full[2:]), (name, shape)
            else:
                assert shape == (rows, *full[1:]), (name, shape, rows)
    rows = e / (ep * edp) if efsdp else e // ep  # experts' worth of elements each rank holds
    total = sum(v.size for v in ref["params"].values())
    experts = sum(v.size for k, v in ref["params"].items() if k.rsplit(".", 1)[-1] in ("w1", "w2", "w3"))
    held = int(experts * rows / e)  # of a whole model's experts (a pipeline stage: of its blocks')
    if par.pp > 1:  # a stage's share
        assert all(r["n_local_params"] < total - experts + held for r in per_rank)
    elif par.tp > 1:  # the attention split over tp, the experts whole: their share and part of the rest
        assert all(held < r["n_local_params"] < total - experts + held for r in per_rank)
    elif par.data_parallel == "ddp":  # dense weights whole, experts 1/ep
        assert all(r["n_local_params"] == total - experts + held for r in per_rank)
    else:  # FSDP2: the dense weights sharded too
        assert all(r["n_local_params"] < total - experts + held for r in per_rank)
