"""Human and JSON renderings of a search result."""

from __future__ import annotations

from typing import Any

from xirang_hpc.planner.cost import Estimate, GiB
from xirang_hpc.planner.search import Result, best_per_layout

_MEM = ("params", "grads", "optimizer", "activations", "buffers")


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f}ms" if s < 1 else f"{s:.2f}s"


def _ep(t: dict[str, float]) -> str:
    return f" + EP all-to-all {_fmt_time(t['ep_comm'])}" if t.get("ep_comm") else ""


def describe(e: Estimate, mem_cap_gb: float) -> list[str]:
    """Three lines: memory breakdown, step-time breakdown, throughput."""
    m, t = e.memory, e.time
    mem = " + ".join(f"{k} {m[k] / GiB:.2f}" for k in _MEM)
    return [
        f"memory/rank  {m['total'] / GiB:.2f} GiB of {mem_cap_gb:g} = {mem}",
        f"step time    {_fmt_time(t['total'])} = compute {_fmt_time(t['compute'])} + TP comm "
        f"{_fmt_time(t['tp_comm'])}{_ep(t)} + "
        + (f"CP K/V comm {_fmt_time(t['cp_comm'])} + " if e.plan.cp > 1 else "")
        + f"bubble {_fmt_time(t['bubble'])} + p2p {_fmt_time(t['p2p'])} + "
        f"exposed DP comm {_fmt_time(t['dp_comm'])} ({e.dp_algo}) + optimizer {_fmt_time(t['optimizer'])}",
        f"throughput   {e.tokens_per_s:,.0f} tokens/s | MFU {100 * e.mfu:.1f}% | "
        f"{e.tflops_per_gpu:.4g} TFLOP/s/rank incl. recompute | {e.microbatches} microbatches",
    ]


def render(res: Result, top: int = 5) -> str:
    """Ranked plans (fastest of each dp/tp/pp layout), with why each runner-up lost."""
    pb = res.problem
    sh, hw = pb.shape, pb.hw
    head = (f"plans for {sh.layers}x{sh.hidden} (heads {sh.heads}, seq {sh.seq}, vocab {sh.vocab}) on "
            f"{pb.nodes} node(s) x {pb.per_node} {hw.name}, global batch {pb.global_batch}: "
            f"{res.evaluated} plans evaluated in {res.seconds * 1e3:.0f} ms, {len(res.ranked)} fit")
    lines = [head]
    if not res.ranked:
        lines.append("no plan fits in memory" + (f": {res.limit}" if res.limit else "; closest candidates:"))
    for i, e in enumerate(best_per_layout(res, top)):
        tag = "recommended" if i == 0 else f"#{i + 1} lost: {res.reasons[id(e)]}"
        lines.append(f"[{i + 1}] {e.plan.label()}  -- {tag}")
        lines += ["    " + x for x in describe(e, hw.mem_gb)]
    for e in res.oom:
        lines.append(f"[x] {e.plan.label()}  -- {res.reasons[id(e)]}")
    return "\n".join(lines)


def render_evaluation(ev: Any) -> str:
    """A given layout (:class:`xirang_hpc.planner.evaluate.Evaluation`): breakdown, fit, rank."""
    e, res = ev.estimate, ev.searched
    hw = res.problem.hw
    lines = [f"layout {e.plan.label()}"] + ["    " + x for x in describe(e, hw.mem_gb)]
    if not e.fits:
        lines.append(f"does NOT fit: needs {e.peak_memory / GiB:.1f} GiB of {hw.mem_gb:g} GiB per rank "
                     f"({max((k for k in e.memory if k != 'total'), key=lambda k: e.memory[k])} largest)")
    elif res.ranked:
        best = res.ranked[0]
        lines.append(f"fits; ranks #{ev.rank} of {len(res.ranked)} fitting plans "
                     f"({100 * ev.slower_than_best:+.1f}% step time vs the recommended {best.plan.label()})")
    return "\n".join(lines)


def to_json(res: Result, top: int = 5) -> dict[str, Any]:
    """Machine-readable result: recommended plan, runners-up with reasons, OOM examples."""
    pb = res.problem
    plans = []
    for i, e in enumerate(best_per_layout(res, top)):
        d = e.to_dict()
        d["rank"] = i + 1
        d["lost_because"] = None if i == 0 else res.reasons[id(e)]
        plans.append(d)
    ooms = [dict(e.to_dict(), lost_because=res.reasons[id(e)]) for e in res.oom]
    return {
        "problem": {"layers": pb.shape.layers, "hidden": pb.shape.hidden, "heads": pb.shape.heads,
                    "seq": pb.shape.seq, "vocab": pb.shape.vocab, "nodes": pb.nodes, "ranks_per_node": pb.per_node,
                    "global_batch": pb.global_batch, "hardware": pb.hw.name},
        "evaluated": res.evaluated,
        "search_seconds": res.seconds,
        "fitting": len(res.ranked),
        "plans": plans,
        "oom": ooms,
    }
