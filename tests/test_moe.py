"""The mixture-of-experts block against transformers' own Qwen3-MoE and Mixtral blocks, and its balancing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import make_cfg, topology

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.gpt import GPT, lm_loss
from xirang_hpc.models.moe import MoE, load_balancing_loss

D, FFN = 32, 16


def _cfg(**kw: object) -> ModelConfig:
    base = dict(name="t", n_layer=2, n_head=4, d_model=D, seq_len=16, norm="rmsnorm", mlp="swiglu", pos="rope",
                bias=False, moe_experts=8, moe_top_k=2, moe_ffn_hidden=FFN)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _copy_from_hf(ours: MoE, hf: torch.nn.Module) -> None:
    """transformers >= 5 stacks experts as gate_up_proj (E, 2*ffn, d) and down_proj (E, d, ffn)."""
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)  # (E, ffn, d) each
        ours.w1.copy_(gate)
        ours.w3.copy_(up)
        ours.w2.copy_(hf.experts.down_proj)


@pytest.mark.parametrize("experts,norm", [(4, True), (8, False), (8, True)])
def test_equals_qwen3_moe_block_and_its_aux_loss(experts: int, norm: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

    torch.manual_seed(0)
    hc = Qwen3MoeConfig(hidden_size=D, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=FFN,
                        norm_topk_prob=norm)
    hf = Qwen3MoeSparseMoeBlock(hc).float()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoE(_cfg(moe_experts=experts, moe_norm_topk=norm))
    _copy_from_hf(ours, hf)
    x = torch.randn(3, 10, D)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)
    hf_logits = hf.gate(x)[0]
    assert ours.router_logits is not None
    torch.testing.assert_close(ours.router_logits, hf_logits, atol=1e-5, rtol=1e-5)
    x2 = torch.randn(2, 7, D)  # a second layer's logits: the loss pools rows over layers
    ours(x2)
    l2 = ours.router_logits
    theirs = load_balancing_loss_func((hf_logits, hf.gate(x2)[0]), experts, 2)
    torch.testing.assert_close(load_balancing_loss([hf_logits, l2], experts, 2), theirs, atol=1e-5, rtol=1e-5)


def test_equals_mixtral_block() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    torch.manual_seed(1)
    hc = MixtralConfig(hidden_size=D, num_local_experts=8, num_experts_per_tok=2, intermediate_size=FFN)
    hf = MixtralSparseMoeBlock(hc).float().eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoE(_cfg(moe_norm_topk=True)).eval()
    _copy_from_hf(ours, hf)
    x = torch.randn(2, 9, D)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)
    logits = hf.gate(x.view(-1, D))[0]
    torch.testing.assert_close(ours.router_logits, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(load_balancing_loss([logits], 8, 2), load_balancing_loss_func((logits,), 8, 2),
                               atol=1e-5, rtol=1e-5)


def test_shared_expert_is_added() -> None:
    torch.manual_seed(2)
    with_shared = MoE(_cfg(moe_shared_ffn_hidden=24))
    plain = MoE(_cfg())
    for p in (*with_shared.parameters(), *plain.parameters()):
        torch.nn.init.normal_(p, std=0.2)
    plain.load_state_dict({k: v for k, v in with_shared.state_dict().items() if not k.startswith("shared.")})
    x = torch.randn(2, 5, D)
    assert with_shared.shared is not None
    torch.testing.assert_close(with_shared(x), plain(x) + with_shared.shared(x), atol=1e-6, rtol=1e-6)


def test_counts_sum_to_tokens_times_top_k_and_imbalance() -> None:
    torch.manual_seed(3)
    m = MoE(_cfg(moe_top_k=3))
    torch.nn.init.normal_(m.gate.weight)
    m(torch.randn(4, 6, D))
    assert int(m.tokens_per_expert.sum()) == 4 * 6 * 3
    assert 1.0 <= m.load_imbalance() <= 8 / 3 + 1e-6


def test_bias_update_moves_toward_balance() -> None:
    m = MoE(_cfg(moe_balance="bias", moe_bias_rate=0.1, moe_experts=4))
    m.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))  # mean 5: expert 0 over, 1 under, 2 and 3 on the mean
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    # The bias steers the choice only: a large bias on expert 3 makes every token pick it, with its own weight.
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    x = torch.randn(5, D)
    _, w, idx = m.route(x)
    assert (idx == 3).any(dim=-1).all()
    m.balance = "none"
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    assert "expert_bias" in m.state_dict()


def test_bias_balancing_in_a_model_updates_after_step() -> None:
    torch.manual_seed(4)
    m = GPT(_cfg(vocab_size=64, moe_balance="bias"))
    m(torch.randint(0, 64, (2, 16)))
    m.moe_after_step()
    blocks = m.moe_blocks()
    assert len(blocks) == 2 and all(b.expert_bias.abs().sum() > 0 for b in blocks)
    assert all(b.load_since_update.sum() == 0 for b in blocks)
    assert m.moe_aux_loss() is None


def test_bias_loads_count_only_training_forwards_with_grad() -> None:
    """A forward without grad, in eval mode, or with ``counting`` off (a pipeline stage's metadata inference)
    adds nothing to the loads; a training forward adds its N*k assignments."""
    m = MoE(_cfg(moe_balance="bias", moe_experts=4))
    x = torch.randn(2, 8, D)
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    m.train()
    m.counting = False
    m(x)
    assert m.load_since_update.sum() == 0
    m.counting = True
    m(x)
    assert m.load_since_update.sum() == 2 * 8 * m.top_k


def test_backward_reaches_selected_experts_and_the_gate() -> None:
    torch.manual_seed(5)
    m = MoE(_cfg(moe_experts=8, moe_top_k=1))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 3, D, requires_grad=True)  # 3 tokens, 1 expert each: at most 3 of 8 experts used
    m(x).pow(2).sum().backward()
    used = m.tokens_per_expert > 0
    assert m.w1.grad is not None and m.w2.grad is not None and m.gate.weight.grad is not None
    assert (m.w1.grad[used].abs().sum(dim=(1, 2)) > 0).all()
    assert (m.w1.grad[~used] == 0).all() and (m.w2.grad[~used] == 0).all()
    assert m.gate.weight.grad.abs().sum() > 0 and x.grad is not None


def _experts_by_autograd(xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                         sizes: list[int], scale: torch.Tensor | None) -> torch.Tensor:
    """The experts as plain autograd computes them: per-expert ``F.linear`` on unbound weights, then the weights."""
    import torch.nn.functional as F

    a, b, c = w1.unbind(0), w3.unbind(0), w2.unbind(0)
    y = torch.cat([F.linear(F.silu(F.linear(x, a[e])) * F.linear(x, b[e]), c[e])
                   for e, x in enumerate(torch.split(xs, sizes))])
    return y if scale is None else y * scale.unsqueeze(-1)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_grouped_experts_equal_autograd_in_values_and_gradients(autocast: bool, weighted: bool) -> None:
    """The hand-written backward of the experts gives autograd's output and gradients (input, all three
    weights, the routing weights), an expert with no rows a zero gradient; under bf16 autocast the output is
    bf16 as ``F.linear``'s (fp32 once times fp32 routing weights), the gradients in the inputs' fp32, equal to
    autograd's within bf16 rounding."""
    from xirang_hpc.models.moe import _GroupedSwiGLU

    torch.manual_seed(3)
    e, d, ffn, sizes = 4, 16, 8, [5, 0, 7, 3]
    ws = [torch.randn(e, ffn, d) * 0.3, torch.randn(e, ffn, d) * 0.3, torch.randn(e, d, ffn) * 0.3]
    xs, scale = torch.randn(sum(sizes), d), torch.rand(sum(sizes))
    gy = torch.randn(sum(sizes), d)
    got, want = [], []
    for fn, out in ((_GroupedSwiGLU.apply, got), (_experts_by_autograd, want)):
        x, w = xs.clone().requires_grad_(True), [t.clone().requires_grad_(True) for t in ws]
        s = scale.clone().requires_grad_(True) if weighted else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(x, *w, sizes, s)
        (y.float() * gy).sum().backward()
        out += [y, x.grad, *(t.grad for t in w), *([s.grad] if s is not None else [])]
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-6, "atol": 1e-6}
    assert got[0].dtype == want[0].dtype == (torch.bfloat16 if autocast and not weighted else torch.float32)
    for name, g, r in zip(("output", "x", "w1", "w3", "w2", "scale")[:len(got)], got, want, strict=True):
        assert g.dtype == r.dtype, name
        torch.testing.assert_close(g.float(), r.float(), **tol, msg=name)
    assert len(got) == (6 if weighted else 5)
    assert all((t[1] == 0).all() for t in got[2:5]), "the expert without rows gets a zero gradient"
    assert all(t[0].abs().sum() > 0 for t in got[2:5])


def test_grouped_experts_per_source_segments_are_bitwise_the_sources_own() -> None:
    """``sources=2`` (expert parallelism: each expert's rows from 2 ranks, one segment each): every output row
    and input gradient is bitwise what each source's own call (``sources=1``, its rows alone, as without expert
    parallelism) gives, and each weight gradient is bitwise the sum of the two sources' (as a 2-rank
    all-reduce adds them), including an expert with rows from one source only and one with none."""
    from xirang_hpc.models.moe import _GroupedSwiGLU

    torch.manual_seed(5)
    e, d, ffn = 3, 16, 8
    own = [[6, 0, 0], [3, 4, 0]]  # rows per expert sent by source 0 and by source 1
    ws = [torch.randn(e, ffn, d) * 0.3, torch.randn(e, ffn, d) * 0.3, torch.randn(e, d, ffn) * 0.3]
    xs = [torch.randn(sum(n), d) for n in own]
    scale = [torch.rand(sum(n)) for n in own]
    gy = [torch.randn(sum(n), d) for n in own]

    def run(x: torch.Tensor, s: torch.Tensor, g: torch.Tensor, sizes: list[int], sources: int) -> list[torch.Tensor]:
        x, s, w = x.clone().requires_grad_(True), s.clone().requires_grad_(True), [t.clone().requires_grad_(True)
                                                                                  for t in ws]
        y = _GroupedSwiGLU.apply(x, *w, sizes, s, sources)
        (y * g).sum().backward()
        return [y.detach(), x.grad, s.grad, *(t.grad for t in w)]

    alone = [run(xs[r], scale[r], gy[r], own[r], 1) for r in range(2)]
    # The expert rank's view: expert-major, source-minor segments, each source's rows in its own order.
    lo = [[sum(own[r][:j]) for j in range(e)] for r in range(2)]
    pick = [(r, j) for j in range(e) for r in range(2)]
    cat = [torch.cat([t[r][lo[r][j]:lo[r][j] + own[r][j]] for r, j in pick]) for t in (xs, scale, gy)]
    both = run(*cat, [own[r][j] for r, j in pick], 2)
    for i, name in enumerate(("output", "x", "scale")):
        want = torch.cat([alone[r][i][lo[r][j]:lo[r][j] + own[r][j]] for r, j in pick])
        assert torch.equal(both[i], want), name
    for i, name in zip((3, 4, 5), ("w1", "w3", "w2"), strict=True):
        assert torch.equal(both[i], alone[0][i] + alone[1][i]), name
        assert (both[i][2] == 0).all() and both[i][1].abs().sum() > 0


def test_moe_gpt_layers_and_aux_loss() -> None:
    cfg = _cfg(n_layer=4, moe_every=2, vocab_size=64)
    assert cfg.moe_layers == (1, 3)
    m = GPT(cfg)
    assert [type(b.mlp).__name__ for b in m.layers.values()] == ["MLP", "MoE", "MLP", "MoE"]
    m(torch.randint(0, 64, (2, 16)))
    aux = m.moe_aux_loss()
    assert aux is not None and aux.requires_grad
    assert _cfg(n_layer=4, moe_first_dense=1).moe_layers == (1, 2, 3)
    dense = ModelConfig(name="d", mlp="swiglu")
    assert dense.moe_layers == () and GPT(dense).moe_aux_loss() is None


def test_meta_build_then_materialize_zeroes_moe_buffers() -> None:
    with torch.device("meta"):
        m = GPT(_cfg(vocab_size=64, moe_balance="bias"))
    m.materialize("cpu", seed=0)
    assert all(b.expert_bias.eq(0).all() for b in m.moe_blocks())
    assert m(torch.randint(0, 64, (1, 8))).isfinite().all()


def test_tiny_moe_gpt_trains_through_the_trainer(stdlib_data: Path, tmp_path: Path) -> None:
    from xirang_hpc.runtime.trainer import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False, "n_layer": 2,
                 "moe_experts": 4, "moe_top_k": 2, "moe_ffn_hidden": 32, "moe_aux_coef": 0.01}
        cfg = make_cfg(1, {}, steps=20, model=model, train={"grad_clip": 1.0})
        tr = Trainer(cfg, topology(0, 1, port), tmp_path, stdlib_data, log=lambda s: None)
        losses = [tr.train_step(s)[0] for s in range(12)]
        assert losses[-1] < losses[0] - 0.3, losses
        assert sum(int(b.tokens_per_expert.sum()) for b in tr.model.moe_blocks()) > 0  # type: ignore[operator]
    finally:
        dist.destroy_process_group()


def test_aux_loss_reaches_the_gate_gradient() -> None:
    torch.manual_seed(6)
    m = GPT(_cfg(vocab_size=64, moe_aux_coef=1.0))
    x = torch.randint(0, 64, (2, 16))
    lm_loss(m(x), x).backward()
    g_lm = m.layers["0"].mlp.gate.weight.grad.clone()
    m.zero_grad()
    out = m(x)
    (lm_loss(out, x) + m.moe_aux_loss()).backward()
    assert not torch.allclose(m.layers["0"].mlp.gate.weight.grad, g_lm)


@pytest.mark.parametrize("kw,field", [
    ({"moe_top_k": 9}, "model.moe_top_k"),
    ({"moe_top_k": 0}, "model.moe_top_k"),
    ({"moe_experts": 0, "moe_top_k": 4}, "model.moe_top_k"),
    ({"moe_experts": 0, "moe_ffn_hidden": 0, "moe_balance": "bias"}, "model.moe_balance"),
    ({"moe_experts": -1}, "model.moe_experts"),
    ({"moe_score": "relu"}, "model.moe_score"),
    ({"moe_balance": "loss"}, "model.moe_balance"),
    ({"mlp": "gelu"}, "model.mlp"),
    ({"moe_every": 0}, "model.moe_every"),
    ({"moe_first_dense": 2}, "model.moe_first_dense"),
    ({"moe_aux_coef": -1.0}, "model.moe_aux_coef"),
])
def test_bad_moe_settings_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(**kw)
    assert field in str(e.value)


def test_moe_in_pipeline_stages_only_without_the_auxiliary_loss_and_with_tensor_parallelism() -> None:
    model = {"mlp": "swiglu", "moe_experts": 4}
    with pytest.raises(ConfigError, match="model.moe_balance.*moe_balance=bias"):  # the auxiliary loss pools all layers
        make_cfg(2, {"pp": 2}, model=model)
    for balance in ("bias", "none"):
        assert make_cfg(2, {"pp": 2}, model={**model, "moe_balance": balance}).parallel.pp == 2
    # Tensor parallelism splits the attention; the experts stay whole on every tp rank (the matrix runs it).
    assert make_cfg(2, {"tp": 2}, model=model).parallel.tp == 2


@pytest.mark.parametrize("parallel,model,why", [
    ({"dp": 4, "ep": 2}, {}, "model.moe_experts=0"),  # a dense model
    ({"dp": 4, "ep": 3}, {"mlp": "swiglu", "moe_experts": 6}, "parallel.dp=4"),  # 3 does not divide dp
    ({"dp": 4, "ep": 4}, {"mlp": "swiglu", "moe_experts": 6}, "model.moe_experts=6"),  # 4 does not divide 6
    ({"dp": 4, "ep": 4, "data_parallel": "fsdp", "dp_replicate": 2}, {"mlp": "swiglu", "moe_experts": 4},
     "dp/dp_replicate=2"),  # HSDP: ep inside one shard group
])
def test_bad_expert_parallel_names_the_rule_and_choices(parallel: dict, model: dict, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        make_cfg(4, parallel, model=model)
    msg = str(e.value)
    assert "parallel.ep" in msg and why in msg, msg
    if model:  # the rule and the valid choices
        assert "choose parallel.ep from [1, 2]" in msg, msg
    if why.startswith("parallel.dp"):
        assert "efsdp*ep" in msg


def test_expert_parallel_refuses_zero1_and_accepts_the_rule() -> None:
    model = {"mlp": "swiglu", "moe_experts": 4}
    with pytest.raises(ConfigError, match=r"parallel.ep_bitwise.*one microbatch a step"):
        make_cfg(2, {"dp": 2, "ep": 2, "ep_bitwise": True, "microbatches": 2}, model=model)
    with pytest.raises(ConfigError, match=r"parallel.ep_bitwise.*only with parallel.ep > 1"):
        make_cfg(2, {"dp": 2, "ep_bitwise": True}, model=model)
    assert make_cfg(2, {"dp": 2, "ep": 2, "ep_bitwise": True}, model=model).parallel.ep_bitwise
    with pytest.raises(ConfigError, match="parallel.zero"):
        make_cfg(2, {"dp": 2, "ep": 2, "zero": 1}, model=model)
    assert make_cfg(4, {"dp": 4, "ep": 2}, model=model).parallel.ep == 2
    assert make_cfg(4, {"ep": 4}, model=model).parallel.dp == 4  # dp derived first, then the rule checked


@pytest.mark.parametrize("replicate,shard,ep,sharded", [
    (1, 4, 2, True),  # FSDP2 over 4, expert groups of 2: each expert sharded over its 2 edp ranks (efsdp)
    (1, 4, 4, False),  # edp = 1: nothing left to shard over
    (4, 1, 2, False),  # DDP, or FSDP2 standing in for it (tp/pp): replicas over edp
    (2, 2, 2, False),  # HSDP with one expert group per shard group: replicas over the replicate groups
    (2, 4, 2, True),  # HSDP, 2 expert groups per shard group: sharded over them (efsdp), replicated over erep
    (1, 4, 1, False),  # no expert parallelism: the experts are FSDP2's like every weight
])
def test_experts_shard_over_efsdp_under_fsdp_and_hsdp(replicate: int, shard: int, ep: int,
                                                                    sharded: bool) -> None:
    from xirang_hpc.runtime.expert_parallel import shards_over_edp
    from xirang_hpc.runtime.parallel_dims import ParallelDims

    dims = ParallelDims(pp=1, dp_replicate=replicate, dp_shard=shard, tp=1, world_size=replicate * shard, ep=ep)
    assert shards_over_edp(dims) is sharded


def _ep_block_rank(rank: int, port: int, skew: bool, out: str, per_source: bool) -> None:
    """One rank of the 2-rank expert-parallel block check: its output rows and every gradient it holds."""
    from torch.distributed.device_mesh import init_device_mesh

    from xirang_hpc.runtime.expert_parallel import apply_expert_parallel
    from xirang_hpc.runtime.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        ref, x = _ep_block_and_input(skew)
        model = torch.nn.Module()
        with torch.device("meta"):
            model.moe = MoE(_cfg())
        ep = apply_expert_parallel(model, mesh, ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1, world_size=2,
                                                             ep=2), per_source=per_source)
        model.moe.to_empty(device="cpu")
        with torch.no_grad():  # the single process's weights, this rank's experts of them
            model.moe.gate.weight.copy_(ref.gate.weight)
            for name in ("w1", "w2", "w3"):
                getattr(model.moe, name).to_local().copy_(getattr(ref, name)[4 * rank : 4 * rank + 4])
        xr = x[2 * rank : 2 * rank + 2].clone().requires_grad_(True)  # this rank's half of the batch
        y = model.moe(xr)
        y.pow(2).sum().backward()
        assert ep is not None
        torch.save({"y": y.detach(), "dx": xr.grad, "gate": model.moe.gate.weight.grad,
                    **{n: getattr(model.moe, n).grad.to_local() for n in ("w1", "w2", "w3")},
                    "received": model.moe.tokens_per_expert.clone()}, out)
    finally:
        dist.destroy_process_group()


def _ep_block_and_input(skew: bool) -> tuple[MoE, torch.Tensor]:
    """A block of 8 experts and a (4, 16, d) batch; ``skew``: the router sends every token to experts 0-3."""
    torch.manual_seed(0)
    ref = MoE(_cfg())
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ref.reset_buffers()
    x = torch.randn(4, 16, D)
    if skew:
        with torch.no_grad():  # only experts 0-3 (rank 0's) read feature 0, which is large and positive: they win
            ref.gate.weight.zero_()
            ref.gate.weight[:4, 0] = torch.tensor([1.0, 0.9, 0.8, 0.7])
            x[..., 0] = x[..., 0].abs() + 5.0
    return ref, x


@pytest.mark.slow
@pytest.mark.parametrize("per_source", [False, True], ids=["per-expert", "per-source"])
@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "one-rank-gets-nothing"])
def test_expert_parallel_block_equals_one_process(tmp_path: Path, skew: bool, per_source: bool) -> None:
    """Two real gloo ranks, 4 experts each, all-to-all dispatch: each rank's output rows and input gradients are
    the single process's, the router gradient sums to it, and each rank's expert gradients are the single
    process's for its experts; also when every token goes to rank 0's experts (rank 1 computes on zero rows
    and must still join the backward's exchanges: a missing one would hang the test)."""
    from ranks import rank_context, run_ranks

    ref, x = _ep_block_and_input(skew)
    xs = x.clone().requires_grad_(True)
    y = ref(xs)
    y.pow(2).sum().backward()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    outs = [str(tmp_path / f"r{r}.pt") for r in range(2)]
    procs = [ctx.Process(target=_ep_block_rank, args=(r, port, skew, outs[r], per_source)) for r in range(2)]
    assert run_ranks(procs, timeout_s=120) == [0, 0]
    got = [torch.load(o) for o in outs]
    if skew:
        assert ref.tokens_per_expert[4:].sum() == 0 and ref.tokens_per_expert[:4].sum() == 2 * 4 * 16
    for r, g in enumerate(got):
        torch.testing.assert_close(g["y"], y[2 * r : 2 * r + 2].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["dx"], xs.grad[2 * r : 2 * r + 2], rtol=1e-5, atol=1e-6)
        # Sums over both ranks' tokens (the all-to-all's backward brought them); per source (ep_bitwise) added per
        # source rank as a data-parallel all-reduce adds them, where one process runs one GEMM over all rows.
        for n in ("w1", "w2", "w3"):
            torch.testing.assert_close(g[n], getattr(ref, n).grad[4 * r : 4 * r + 4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0]["gate"] + got[1]["gate"], ref.gate.weight.grad, rtol=1e-5, atol=1e-6)
    if skew:
        assert torch.count_nonzero(got[1]["w1"]) == 0
