"""A Mixture-of-Experts feed-forward block (token-choice top-k routing over SwiGLU experts).

The block replaces a dense MLP: a linear router without bias scores every token against every
expert, each token goes to its ``top_k`` best experts and the output is the routing-weighted sum
of those experts' SwiGLU outputs (plus an optional dense shared expert, as in Qwen2-MoE and
DeepSeek). It computes what Hugging Face's ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``
compute, with a different dispatch: tokens are sorted by expert once (an argsort of the flat
top-k indices) and every expert runs one matmul chain on its contiguous slice, instead of a
one-hot mask and a ``torch.where`` per expert.

Expert weights are stacked per expert so that they map one to one onto Hugging Face's per-expert
tensors: ``w1[e]`` is ``experts.{e}.gate_proj.weight`` (ffn, d), ``w3[e]`` is ``up_proj`` (ffn, d)
and ``w2[e]`` is ``down_proj`` (d, ffn); transformers >= 5 fuses them as
``gate_up_proj = cat(w1, w3, dim=1)`` and ``down_proj = w2``.

Load balancing, one of:

- ``aux_loss``: the Switch-Transformer auxiliary loss exactly as transformers'
  ``load_balancing_loss_func`` computes it over all MoE layers (:func:`load_balancing_loss`),
  added to the language-model loss times ``moe_aux_coef`` (:meth:`GPT.moe_aux_loss`);
- ``bias``: auxiliary-loss-free balancing (DeepSeek-V3): a non-trainable per-expert bias is added
  to the scores for the top-k *selection* only (the weights still come from the unbiased scores),
  and after every optimizer step ``bias += rate * sign(mean_load - load)`` (:meth:`MoE.update_bias`);
- ``none``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from xirang_hpc.config.schema import ModelConfig


class SwiGLU(nn.Module):
    """A dense SwiGLU feed-forward without biases (the shared expert), named as Hugging Face's MLPs."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., d)."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all layers, as transformers' ``load_balancing_loss_func``.

    ``router_logits``: one (N, E) tensor per MoE layer. Counts and probabilities are summed over
    *all* layers' rows before the product (not a mean of per-layer losses), which is what
    Hugging Face does for Mixtral and Qwen-MoE: ``E * sum_e f_e * P_e`` with ``f_e`` the top-k
    assignments of expert e per row and ``P_e`` its mean softmax probability. Only ``P`` carries
    gradient (the counts come from a top-k).

    ``group``: the data-parallel ranks that together hold the batch. The loss is a product of two batch
    means, so a per-rank loss would not be the batch's; instead the counts and row totals are summed over
    the group (one all-reduce, no gradient needed) and each rank returns ``n * E * sum_e f_e * P_e(local)``
    (n ranks): the data-parallel mean of these values, and of their gradients, is the whole batch's loss.
    """
    dev = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    rows = 0
    for logits in router_logits:
        # Softmax in fp32 whatever the routing score is: the loss is defined on softmax probabilities.
        p = torch.softmax(logits.float(), dim=-1)  # (N, E)
        idx = torch.topk(p, top_k, dim=-1).indices  # (N, k)
        counts = counts + torch.bincount(idx.reshape(-1), minlength=num_experts).float()  # (E,)
        probs = probs + p.sum(dim=0)  # (E,)
        rows += p.shape[0]
    if group is None or dist.get_world_size(group) == 1:
        return num_experts * torch.sum((counts / rows) * (probs / rows))
    stats = torch.cat([counts, torch.tensor([float(rows)], device=dev)])  # (E + 1,): counts, then rows
    dist.all_reduce(stats, group=group)
    counts, total = stats[:-1], stats[-1]
    return dist.get_world_size(group) * num_experts * torch.sum((counts / total) * (probs / total))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange (gloo and nccl).

    Row ``i`` of the output came from some rank's input row; its gradient goes back to that row, which is
    the same exchange with the split sizes swapped.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))  # (sum(out_splits), d)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))  # (sum(in_splits), d)
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _GroupedSwiGLU(torch.autograd.Function):
    """Every local expert's SwiGLU on its contiguous slice of rows, each output row optionally times its routing
    weight, with a hand-written backward.

    xs (S, d) holds ``sizes[e]`` rows for expert e in order; w1, w3 (E, ffn, d), w2 (E, d, ffn); ``scale``
    (S,) or None -> (S, d): row i is ``scale[i] * (silu(x_i w1^T) * (x_i w3^T)) w2^T``, the weight applied after
    the down projection as Hugging Face does. Autograd over per-expert ``F.linear`` calls on ``unbind``-ed weights
    and a separate weighting would keep four (S, ffn) activations and the (S, d) unweighted outputs, and stack
    the E per-expert weight gradients into a new (E, ...) tensor per weight; here each expert's gradient is
    written straight into its row of one (E, ...) gradient by ``torch.mm(out=)``, only the two projections are
    kept, the SwiGLU product is recomputed in backward, and the routing weight's gradient comes from the down
    projection's input gradient (``sum(dy * (a w2^T)) = sum((dy w2) * a)``), so no output is kept either.
    The GEMMs are autograd's; silu's derivative is aten's ``silu_backward``. Under autocast the GEMMs run in
    its dtype, as ``F.linear`` would, the weighted output has ``y * scale``'s dtype, and the gradients come back
    in the inputs' dtypes. An expert with no rows gets a zero gradient; the output depends on every weight, so a
    rank that received no token still runs the backward (and its all-to-alls) under expert parallelism.

    ``sources`` > 1 (expert parallelism): ``sizes`` has ``sources`` segments per expert, the rows each ep rank
    sent, and every GEMM runs per segment, so each source's rows meet exactly the GEMMs its own rank would run
    on them without expert parallelism. An expert's weight gradient is then the sum of its sources' gradients
    as a balanced binary tree over the ep ranks, ((r0 + r1) + (r2 + r3)), which is how the data-parallel
    reductions of fewer expert ranks add them on these sizes (a 2-rank all-reduce, the 2 x 2 hierarchical one,
    an edp all-reduce or reduce-scatter of two such sums): with ``parallel.ep_bitwise`` a change of ``ep`` on
    the same 2 or 4 ranks trains bitwise alike (one microbatch a step; tests/test_checkpoint_resume.py).
    Smaller GEMMs cost more per row, which is why it is a choice.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, xs: torch.Tensor, w1: torch.Tensor,  # type: ignore[override]
                w3: torch.Tensor, w2: torch.Tensor, sizes: list[int], scale: torch.Tensor | None,
                sources: int = 1) -> torch.Tensor:
        kind = xs.device.type
        dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else xs.dtype
        ctx.dtypes = (xs.dtype, w1.dtype, w3.dtype, w2.dtype)
        with torch.autocast(kind, enabled=False):
            x, a1, a3, a2 = (t.to(dt) for t in (xs, w1, w3, w2))
            sc = None if scale is None else scale.unsqueeze(-1)  # (S, 1), in its own dtype
            # The weighted output in the dtype ``y * scale`` has (fp32 for a bf16 autocast y and fp32 weights).
            od = dt if sc is None else torch.promote_types(dt, sc.dtype)
            ffn = a1.shape[1]
            h1 = x.new_empty((x.shape[0], ffn))  # (S, ffn) gate projections
            h3 = x.new_empty((x.shape[0], ffn))  # (S, ffn) up projections
            ys = x.new_empty(x.shape, dtype=od)  # (S, d)
            lo = 0
            for i, n in enumerate(sizes):
                e = i // sources  # the segment's expert
                if n:
                    xe, ye = x[lo:lo + n], ys[lo:lo + n]  # (n, d)
                    torch.mm(xe, a1[e].t(), out=h1[lo:lo + n])
                    torch.mm(xe, a3[e].t(), out=h3[lo:lo + n])
                    a = F.silu(h1[lo:lo + n]) * h3[lo:lo + n]  # (n, ffn)
                    if sc is None:
                        torch.mm(a, a2[e].t(), out=ye)
                    elif od == dt:
                        torch.mm(a, a2[e].t(), out=ye).mul_(sc[lo:lo + n])
                    else:
                        torch.mul(a @ a2[e].t(), sc[lo:lo + n], out=ye)
                lo += n
        ctx.sizes, ctx.sources = sizes, sources
        ctx.save_for_backward(x, a1, a3, a2, h1, h3, sc)
        return ys

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor | None, ...]:
        x, a1, a3, a2, h1, h3, sc = ctx.saved_tensors  # type: ignore[attr-defined]
        sizes, sources = ctx.sizes, ctx.sources  # type: ignore[attr-defined]
        # The GEMMs take the unweighted output's gradient in the compute dtype; the weight enters after them.
        gy = gy.to(x.dtype)
        gx = torch.empty_like(x)  # (S, d)
        g1, g3, g2 = torch.empty_like(a1), torch.empty_like(a3), torch.empty_like(a2)
        gs = None if sc is None else torch.empty_like(sc)  # (S, 1), in the weights' dtype
        sd = None if sc is None else sc.to(x.dtype)
        lo = 0
        for e in range(a1.shape[0]):
            # The sources' (g1, g3, g2) contributions summed as a balanced binary tree while they are computed:
            # (level, partial sum) pairs, None an empty one. The first source with rows writes straight into the
            # expert's rows of the stacked gradients, which stay the left operand of every sum (IEEE addition
            # commutes, so that changes no bit); the others need one temporary each, at most log2(sources) + 1.
            tree: list[tuple[int, tuple[torch.Tensor, ...] | None]] = []
            into_grad = True
            for n in sizes[e * sources:(e + 1) * sources]:
                part = None
                if n:
                    part = (g1[e], g3[e], g2[e]) if into_grad else tuple(torch.empty_like(t[e]) for t in (a1, a3, a2))
                    into_grad = False
                    xe, dy, p1, p3 = x[lo:lo + n], gy[lo:lo + n], h1[lo:lo + n], h3[lo:lo + n]
                    act = F.silu(p1)  # (n, ffn)
                    a = act * p3  # (n, ffn) the down projection's input
                    du = dy @ a2[e]  # (n, ffn) gradient of a for an unweighted output
                    if sc is None:
                        torch.mm(dy.t(), a, out=part[2])  # (d, ffn)
                        da = du
                    else:
                        s = sd[lo:lo + n]  # type: ignore[index]  # (n, 1)
                        gs[lo:lo + n] = torch.sum(du * a, dim=-1, keepdim=True, dtype=gs.dtype)  # type: ignore[index]
                        torch.mm(dy.t(), a * s, out=part[2])
                        da = du * s
                    d3 = da * act
                    d1 = torch.ops.aten.silu_backward(da * p3, p1)  # the kernel autograd's silu uses
                    torch.mm(d1.t(), xe, out=part[0])  # (ffn, d)
                    torch.mm(d3.t(), xe, out=part[1])
                    torch.mm(d1, a1[e], out=gx[lo:lo + n])  # (n, d)
                    gx[lo:lo + n].addmm_(d3, a3[e])
                    lo += n
                level = 0
                while tree and tree[-1][0] == level:  # two subtrees of equal size: add them
                    part = _add_parts(tree.pop()[1], part)
                    level += 1
                tree.append((level, part))
            total = tree.pop()[1]
            while tree:  # unequal subtrees left (a source count not a power of two): right to left
                total = _add_parts(tree.pop()[1], total)
            if total is None:  # the expert got no row from any source
                g1[e].zero_(), g3[e].zero_(), g2[e].zero_()
        dx, d1t, d3t, d2t = ctx.dtypes  # type: ignore[attr-defined]
        return gx.to(dx), g1.to(d1t), g3.to(d3t), g2.to(d2t), None, None if gs is None else gs.squeeze(-1), None


def _add_parts(left: tuple[torch.Tensor, ...] | None, right: tuple[torch.Tensor, ...] | None
               ) -> tuple[torch.Tensor, ...] | None:
    """``left + right`` tensor by tensor, in place into ``left``; ``None`` is an exact zero (``a + 0`` is ``a``)."""
    if left is None or right is None:
        return right if left is None else left
    for a, b in zip(left, right, strict=True):
        a.add_(b)
    return left


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight: the DTensor shard under expert parallelism (autograd-aware)."""
    return t.to_local() if isinstance(t, DTensor) else t


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert): (B, T, d) -> (B, T, d).

    After each forward: ``router_logits`` (N, E) of that forward (for the auxiliary loss),
    ``tokens_per_expert`` (E,) assignments of that forward (a non-persistent buffer, for logging)
    and :meth:`load_imbalance` (max/mean of those counts; 1.0 is perfectly balanced).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, ffn, e = cfg.d_model, cfg.moe_ffn_dim, cfg.moe_experts
        self.num_experts, self.top_k = e, cfg.moe_top_k
        self.score, self.norm_topk, self.balance = cfg.moe_score, cfg.moe_norm_topk, cfg.moe_balance
        self.bias_rate = cfg.moe_bias_rate
        self.gate = nn.Linear(d, e, bias=False)  # the router: weight (E, d)
        self.w1 = nn.Parameter(torch.empty(e, ffn, d))  # gate_proj per expert
        self.w3 = nn.Parameter(torch.empty(e, ffn, d))  # up_proj per expert
        self.w2 = nn.Parameter(torch.empty(e, d, ffn))  # down_proj per expert
        self.shared = SwiGLU(d, cfg.moe_shared_ffn_hidden) if cfg.moe_shared_ffn_hidden else None
        # State, not weights: the selection bias is checkpointed (persistent) but never trained; the
        # counts are per-forward observations. Both are zeroed by reset_buffers (meta-built models too).
        self.register_buffer("expert_bias", torch.zeros(e), persistent=cfg.moe_balance == "bias")
        self.register_buffer("tokens_per_expert", torch.zeros(e), persistent=False)
        # Assignments summed over the forwards since the last bias update (micro-steps of one step).
        self.register_buffer("load_since_update", torch.zeros(e), persistent=False)
        self.router_logits: torch.Tensor | None = None
        # False while a forward is not a training step's (a pipeline stage's metadata inference): its
        # assignments are not added to ``load_since_update``.
        self.counting = True
        # Expert parallelism (set by xirang_hpc/runtime/expert_parallel.py): w1/w2/w3 are then DTensors sharded
        # on the expert dim over ep_size ranks, this rank holding experts [ep_rank*E/ep_size, (ep_rank+1)*E/ep_size).
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = 1
        # parallel.ep_bitwise: each source rank's rows through GEMMs of their own (:class:`_GroupedSwiGLU`).
        self.ep_per_source = False

    def reset_buffers(self) -> None:
        """Zero the bias and the counters (after ``to_empty``, whose buffers hold garbage)."""
        for b in (self.expert_bias, self.tokens_per_expert, self.load_since_update):
            b.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> (router logits (N, E), top-k weights (N, k) in x's dtype, top-k expert ids (N, k))."""
        logits = self.gate(x)  # (N, E), in the activation dtype as Hugging Face's router
        w, idx = self.select(logits)
        return logits, w.to(x.dtype), idx

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> (top-k weights (N, k) in fp32, top-k expert ids (N, k)).

        Apart from the gate's matmul so that ``train.compile`` can compile it alone (runtime/compile.py): the
        gate is a module of its own that FSDP2 may shard, and its hooks stay outside any graph.
        """
        # Scores in fp32: a bf16 softmax over many experts loses the small probabilities' ordering.
        scores = torch.softmax(logits.float(), dim=-1) if self.score == "softmax" else torch.sigmoid(logits.float())
        # The bias steers which experts are chosen, never how much they weigh (DeepSeek-V3).
        choose = scores + self.expert_bias if self.balance == "bias" else scores  # (N, E)
        idx = torch.topk(choose, self.top_k, dim=-1).indices  # (N, k)
        w = scores.gather(1, idx)  # (N, k)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d) -> (B, T, d)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, d), N = B*T tokens
        logits, w, idx = self.route(x2)
        self.router_logits = logits
        k = self.top_k
        flat = idx.reshape(-1)  # (N*k,): slot j = token j//k's (j%k)-th choice
        # Group the N*k (token, choice) slots by expert; stable so each expert sees its tokens in order.
        order = torch.argsort(flat, stable=True)  # (N*k,)
        token = order // k  # (N*k,): source token of each sorted slot
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        # Only the training forwards' loads steer the bias, as one process counts them: not a forward
        # without grad, nor a pipeline stage's metadata inference (``counting`` off, runtime/pipeline.py),
        # which runs the stage once with grad on the first microbatch or on placeholder activations.
        counting = self.training and self.counting and torch.is_grad_enabled()
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts)
            if counting:
                self.load_since_update.add_(counts)
        ws = w.reshape(-1).index_select(0, order)  # (N*k,) each sorted slot's routing weight
        # index_select, not x2[token]: its backward is one index_add_, where indexing's is an accumulating
        # index_put_ (several times slower on CPU). One gather for all experts: one gradient for x2 in backward.
        xs = x2.index_select(0, token)  # (N*k, d), expert 0's slots first, then expert 1's, ...
        sizes = counts.tolist()  # one host sync for the split sizes (the only one without expert parallelism)
        if self.ep_group is None:  # E x (n_e, d), each row times its routing weight (as Hugging Face: after down)
            ys = torch.split(self._experts(xs, sizes, ws), sizes)
        else:  # the same slots, computed (and weighted) by their experts' ranks
            ys = torch.split(self._dispatch_and_combine(xs, ws, counts, sizes), sizes)
        # (N, d): each expert's weighted outputs added into a tensor of its own, in place, one expert at a time (a
        # token picks an expert once: no row added twice in one call), so the outputs are never concatenated nor
        # permuted back to the tokens' order.
        out = torch.zeros_like(x2)
        for ye, te in zip(ys, torch.split(token, sizes), strict=True):
            if te.numel():
                out.index_add_(0, te, ye)
        # (B, T, d). The block returns a tensor of its own, not a view, on which FSDP2 (experts sharded over edp)
        # hooks its backward: the shared expert's sum is one, else a copy (N x d, small beside the experts).
        if self.shared is not None:
            return out.view(shape) + self.shared(x2).view(shape)
        return out.view(shape).clone()

    def _experts(self, xs: torch.Tensor, sizes: list[int], scale: torch.Tensor | None = None,
                 sources: int = 1) -> torch.Tensor:
        """Run the experts held here on contiguous slices: xs (sum(sizes), d) -> (sum(sizes), d).

        ``sizes[e * sources + s]`` rows of ``xs`` belong to this rank's e-th expert (from ep rank s), in order;
        ``scale`` (sum(sizes),): each output row's routing weight, or None (:class:`_GroupedSwiGLU`).
        """
        w1, w3, w2 = (_local(t) for t in (self.w1, self.w3, self.w2))  # (E, ffn, d), (E, ffn, d), (E, d, ffn)
        return _GroupedSwiGLU.apply(xs, w1, w3, w2, sizes, scale, sources)

    def _dispatch_and_combine(self, xs: torch.Tensor, ws: torch.Tensor, counts: torch.Tensor,
                              sizes: list[int]) -> torch.Tensor:
        """Expert parallelism: send each slot to the rank holding its expert, run, send the result back.

        xs (N*k, d) is sorted by expert, ``ws`` (N*k,) its routing weights (they travel with the rows, one more
        column, so each expert's rank weighs its outputs as one process does), ``counts`` (E,) its slots per
        expert. Expert e lives on ep rank
        e // (E/ep), so the slots for one destination are contiguous. The split sizes are exchanged first
        (an all-to-all of the counts), then the rows; what arrives is ordered (source rank, local expert)
        and is regrouped to (local expert, source rank) so each local expert runs on one contiguous slice,
        with its tokens in the order one process would give them (sources are consecutive batch shards).
        ``sizes``: ``counts`` on the host (the caller's list). The split sizes are summed on the host from
        ``sizes`` and the received counts, so the exchange costs one device sync (the received counts).
        """
        ep, group = self.ep_size, self.ep_group
        local_e = self.num_experts // ep
        send = counts.reshape(ep, local_e)  # (ep, E/ep): my slots for each destination's local experts
        recv = torch.empty_like(send)  # (ep, E/ep): recv[s, j] slots rank s sends to my expert j
        dist.all_to_all_single(recv, send.contiguous(), group=group)
        got = recv.reshape(-1).tolist()  # chunk sizes in (source, expert) order: recv[s, j] at s*local_e + j
        in_splits = [sum(sizes[r * local_e:(r + 1) * local_e]) for r in range(ep)]
        out_splits = [sum(got[r * local_e:(r + 1) * local_e]) for r in range(ep)]
        xw = torch.cat([xs, ws.unsqueeze(-1)], dim=1)  # (N*k, d+1): each row and its routing weight
        xr = _AllToAll.apply(xw, out_splits, in_splits, group)  # (sum(recv), d+1), (source, expert) order
        by_expert = [s * local_e + j for j in range(local_e) for s in range(ep)]  # chunk order (expert, source)
        chunks = torch.split(xr, got)
        # Each local expert's rows contiguous, the rows (sum(recv), d) apart from their weights (sum(recv),): a
        # GEMM reads its rows from a contiguous tensor, as without expert parallelism (same values, same kernel).
        xe = torch.cat([chunks[i][:, :-1] for i in by_expert])
        we = torch.cat([chunks[i][:, -1] for i in by_expert])
        segments = [got[i] for i in by_expert]  # rows per (expert, source)
        if self.ep_per_source:  # each source's rows on their own GEMMs: a change of ep continues bitwise
            ye = self._experts(xe, segments, we, sources=ep)  # (sum(recv), d), weighted
        else:  # each expert's rows, all sources together, on one chain of GEMMs
            per_expert = [sum(segments[j * ep:(j + 1) * ep]) for j in range(local_e)]
            ye = self._experts(xe, per_expert, we)
        ychunks = torch.split(ye, segments)
        # back to (source, expert) order: chunk (s, j) sits at position j*ep + s of the expert-major list
        yr = torch.cat([ychunks[j * ep + s] for s in range(ep) for j in range(local_e)])  # (sum(recv), d)
        return _AllToAll.apply(yr, in_splits, out_splits, group)  # (N*k, d), my slots in their sorted order

    def load_imbalance(self) -> float:
        """max/mean tokens per expert in the last forward (1.0 = perfectly balanced, E/k = all on k experts)."""
        c = self.tokens_per_expert.float()
        return float(c.max() / c.mean().clamp_min(1e-9))

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None) -> None:
        """DeepSeek-V3's balancing step: ``bias += rate * sign(mean_load - load)``; resets the load counter.

        ``load``: per-expert assignments to use (e.g. summed over data-parallel ranks); by default
        those counted on this rank since the last update. Underloaded experts gain bias, overloaded lose.
        """
        load = self.load_since_update if load is None else load
        self.expert_bias.add_(self.bias_rate * torch.sign(load.float().mean() - load.float()))
        self.load_since_update.zero_()
