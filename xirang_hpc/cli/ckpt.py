"""``xirang-ckpt``: list, inspect, verify, rollback, prune, pin, export and tune a run's checkpoints.

``RUN`` is a run directory (holding ``checkpoints/``) or the checkpoints directory itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.files import private_by_default


class Refused(Exception):
    """A request refused (no such run, step or file; a bad flag): one error line, exit status 2, as the help says."""


def _root(run: str) -> Path:
    p = Path(run).expanduser().absolute()
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not root.is_dir():
        raise Refused(f"{p} is not a run directory (no checkpoints/ inside)")
    return root


def _step(root: Path, step: int | None) -> int:
    steps = ckpt_layout.committed_steps(root)
    if not steps:
        raise Refused(f"no checkpoints under {root}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise Refused(f"no checkpoint for step {step} under {root} (have {steps})")
    return step


def cmd_list(a: argparse.Namespace) -> int:
    """Table of steps, sizes, commit times, layouts."""
    root = _root(a.run)
    latest = ckpt_layout.read_latest(root)
    print(f"{'step':>8}  {'size MB':>9}  {'committed (UTC)':<19}  {'ranks':>5}  {'layout':<16}  flags")
    for s in ckpt_layout.describe(root):
        dims = s.layout.get("dims", {})
        lay = "x".join(f"{k}{v}" for k, v in dims.items() if v and v > 1) or "-"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.committed_at)) if s.committed_at else "?"
        flags = [f for f, on in (("latest", s.step == latest), ("pinned", s.pinned),
                                 ("refs:" + ",".join(r.rsplit("/", 1)[-1] for r in s.refs), bool(s.refs)),
                                 ("UNREADABLE", s.bytes < 0)) if on]
        size = f"{s.bytes / 1e6:9.2f}" if s.bytes >= 0 else f"{'?':>9}"
        print(f"{s.step:>8}  {size}  {when:<19}  {s.world_size:>5}  {lay:<16}  {' '.join(flags)}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    """Manifest, run state and tensor table of one step."""
    from xirang_hpc.checkpoint.storage import read_metadata

    root = _root(a.run)
    d = root / ckpt_layout.step_dir_name(_step(root, a.step))
    m, st = ckpt_layout.read_manifest(d), ckpt_layout.read_state(d)
    print(f"checkpoint {d}")
    for k in ("step", "world_size", "new_bytes", "ref_bytes", "stall_s", "persist_s", "refs", "layout"):
        print(f"  {k:<12} {m.get(k)}")
    print(f"  tokens_seen  {st.get('tokens_seen')}   initial_val_loss {st.get('initial_val_loss')}")
    print(f"  lr_schedule  {st.get('lr_schedule')}")
    print(f"  model        {st.get('config', {}).get('model', {}).get('name')}")
    print("  tensors:")
    for fqn, t in sorted(read_metadata(d).state_dict_metadata.items()):
        size = tuple(getattr(t, "size", ()))
        chunks = len(getattr(t, "chunks", []))
        print(f"    {fqn:<60} {str(size):<16} {str(getattr(t, 'properties', None) and t.properties.dtype):<16} "
              f"{chunks} chunk(s)")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    """Check sizes and checksums of every file (all steps, or one); exit 2 if any is bad or there is none.

    ``--fast``: the check every launch and load makes (sizes of every file, checksums of the small
    ones; no tensor file read).
    """
    root = _root(a.run)
    steps = [_step(root, a.step)] if a.step is not None else ckpt_layout.committed_steps(root)
    if not steps:
        raise FileNotFoundError(f"no checkpoints under {root}")
    bad = 0
    for s in steps:
        try:
            d = root / ckpt_layout.step_dir_name(s)
            ckpt_layout.verify_quick(d) if a.fast else ckpt_layout.verify(d)
            print(f"step {s}: OK")
        except ckpt_layout.CheckpointCorruptError as exc:
            bad += 1
            print(f"step {s}: CORRUPT: {exc}")
    if bad:
        print(f"xirang-ckpt: error: {bad} of {len(steps)} checkpoint(s) under {root} fail verification",
              file=sys.stderr)
    return 2 if bad else 0


def cmd_rollback(a: argparse.Namespace) -> int:
    """Fork a new run directory from one step; the original stays as it is."""
    from xirang_hpc.checkpoint.rollback import fork_run

    root = _root(a.run)
    step = _step(root, a.step)
    new = fork_run(root.parent, step, Path(a.to).absolute() if a.to else None)
    print(f"forked {root.parent} at step {step} -> {new}")
    print(f"continue with: xirang-train ... train.run_dir={new}")
    return 0


def cmd_prune(a: argparse.Namespace) -> int:
    """Apply a retention policy now (defaults: the run's own checkpoint config)."""
    from xirang_hpc.checkpoint.retention import RetentionPolicy, prune

    root = _root(a.run)
    state = ckpt_layout.read_state(root / ckpt_layout.step_dir_name(_step(root, None)))
    cfg = state.get("config", {}).get("checkpoint", {})
    pol = RetentionPolicy(a.keep_last if a.keep_last is not None else cfg.get("keep_last", 3),
                          a.keep_every if a.keep_every is not None else cfg.get("keep_every", 0),
                          tuple(cfg.get("pinned", [])))
    gone = prune(root, pol, dry_run=a.dry_run)
    print(f"{'would remove' if a.dry_run else 'removed'}: {gone or 'nothing'} (policy {pol})")
    return 0


def cmd_pin(a: argparse.Namespace) -> int:
    """Mark a step so retention never removes it (``--unpin`` to undo)."""
    root = _root(a.run)
    marker = root / ckpt_layout.step_dir_name(_step(root, a.step)) / ckpt_layout.PINNED
    marker.unlink(missing_ok=True) if a.unpin else marker.touch()
    print(f"{'unpinned' if a.unpin else 'pinned'} step {a.step}")
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    """Write full model weights: safetensors plus our JSON config, or a Hugging Face directory."""
    from xirang_hpc.weights.export import export_safetensors

    if a.format not in ("safetensors", "hf", "peft"):
        raise Refused(f"--format {a.format!r} is not supported; use safetensors, hf or peft")
    if a.merge and a.format != "hf":
        raise Refused("--merge applies to --format hf only")
    root = _root(a.run)
    step = _step(root, a.step)
    if a.format == "peft":
        from xirang_hpc.weights.peft import export_peft

        out = Path(a.out) if a.out else root.parent / "export" / f"peft_step_{step}"
        files = export_peft(root / ckpt_layout.step_dir_name(step), out)
        size = sum(f.stat().st_size for f in files)
        print(f"wrote {out} ({len(files)} files, {size / 1e6:.2f} MB): load it with "
              f"peft.PeftModel.from_pretrained(base_model, {str(out)!r})")
        return 0
    if a.format == "hf":
        from xirang_hpc.weights.hf import export_hf

        out = Path(a.out) if a.out else root.parent / "export" / f"hf_step_{step}"
        files = export_hf(root / ckpt_layout.step_dir_name(step), out, dtype=a.dtype,
                          max_shard_bytes=int(a.max_shard_mb * 2**20), merge=a.merge)
        size = sum(f.stat().st_size for f in files)
        print(f"wrote {out} ({len(files)} files, {size / 1e6:.2f} MB): load it with "
              f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
        return 0
    if a.dtype != "float32":
        raise Refused("--dtype applies to --format hf only")
    out = Path(a.out) if a.out else root.parent / "export" / f"step_{step}"
    w, c = export_safetensors(root / ckpt_layout.step_dir_name(step), out)
    print(f"wrote {w} ({w.stat().st_size / 1e6:.2f} MB) and {c}")
    return 0


def cmd_interval(a: argparse.Namespace) -> int:
    """Daly's interval from this run's measured save costs, step time and failure history."""
    from xirang_hpc.checkpoint.tuner import IntervalTuner, read_history

    root = _root(a.run)
    infos = [ckpt_layout.read_manifest(root / ckpt_layout.step_dir_name(s)) for s in ckpt_layout.committed_steps(root)]
    infos = [m for m in infos if "stall_s" in m]
    if not infos:
        raise Refused(f"{root} has no measured saves yet")
    st = ckpt_layout.read_state(root / ckpt_layout.step_dir_name(infos[-1]["step"]))
    cfg = st.get("config", {})
    mtbf_h = a.mtbf_hours if a.mtbf_hours is not None else cfg.get("checkpoint", {}).get("mtbf_hours", 24.0)
    tuner = IntervalTuner(mtbf_s=mtbf_h * 3600, history=read_history(root), restart_s=a.restart_s)
    tokens_per_step = cfg.get("train", {}).get("global_batch", 1) * cfg.get("model", {}).get("seq_len", 1)
    rates = [r["tokens_per_s"] for r in st.get("metrics", []) if r.get("tokens_per_s")]
    step_s = tokens_per_step / sorted(rates)[len(rates) // 2] if rates else 0.0
    for m in infos:
        tuner.observe(m["stall_s"], m["persist_s"], step_s)
    rec = tuner.recommendation()
    if a.json:
        print(json.dumps(rec, indent=1))
        return 0
    print(f"inputs: stall {rec['stall_s']:.3f}s per save (blocking), persist {rec['persist_s']:.3f}s (background), "
          f"step {rec['step_s']:.3f}s, MTBF {rec['mtbf_s'] / 3600:.2f}h from {rec['mtbf_source']}, "
          f"restart {rec['restart_s']:.0f}s")
    print(f"Daly interval {rec['daly_interval_s']:.1f}s; bounded below by persist -> {rec['interval_s']:.1f}s "
          f"= every {rec['interval_steps']} steps (checkpoint.every_steps={rec['interval_steps']})")
    print(f"expected waste {rec['expected_waste_pct']:.2f}%")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    from xirang_hpc.cli.help import argparse_texts

    p = argparse.ArgumentParser(prog="xirang-ckpt", **argparse_texts("xirang-ckpt"))  # type: ignore[arg-type]
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn: object, step: bool = True, help_: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("run", help="run directory (or its checkpoints/ directory)")
        if step:
            sp.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
        sp.set_defaults(fn=fn)
        return sp

    add("list", cmd_list, step=False, help_="steps, sizes, times, layouts")
    add("inspect", cmd_inspect, help_="manifest, state and tensors of a step")
    add("verify", cmd_verify, help_="check sizes and checksums (all steps by default)").add_argument(
        "--fast", action="store_true", help="sizes of every file, checksums of the small ones (as each launch checks)")
    add("rollback", cmd_rollback, help_="fork a new run directory from a step").add_argument("--to", default=None)
    sp = add("prune", cmd_prune, step=False, help_="apply retention now")
    sp.add_argument("--keep-last", type=int, default=None)
    sp.add_argument("--keep-every", type=int, default=None)
    sp.add_argument("--dry-run", action="store_true")
    add("pin", cmd_pin, help_="protect a step from retention").add_argument("--unpin", action="store_true")
    sp = add("export", cmd_export, help_="export model weights")
    sp.add_argument("--format", default="safetensors",
                    help="safetensors: model.safetensors + our config; hf: a Hugging Face (transformers) directory; "
                    "peft: a LoRA run's adapters as a PEFT adapter directory")
    sp.add_argument("--merge", action="store_true",
                    help="--format hf of a LoRA run: the adapters added into the base (model.init_from)")
    sp.add_argument("--out", default=None, help="output directory (default: RUN/export/step_N or hf_step_N)")
    sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="tensor dtype (--format hf)")
    sp.add_argument("--max-shard-mb", type=float, default=5120.0,
                    help="--format hf: split weights into shards of at most this size, with an index")
    sp = add("interval", cmd_interval, step=False, help_="recommended checkpoint interval (Daly)")
    sp.add_argument("--mtbf-hours", type=float, default=None)
    sp.add_argument("--restart-s", type=float, default=0.0, help="time to restart after a failure")
    sp.add_argument("--json", action="store_true")
    return p


# Subcommands that change a run or hand its weights out: recorded in its audit trail.
_AUDITED = {"export": "export", "rollback": "fork", "prune": "prune", "pin": "pin"}


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    a = build_parser().parse_args(argv)
    private_by_default()  # exports and forks are the user's own
    try:
        if a.cmd == "pin" and a.step is None:
            raise Refused("pin needs --step")
        rc = a.fn(a)
        if rc == 0 and a.cmd in _AUDITED and not getattr(a, "dry_run", False):
            from xirang_hpc.monitor import audit

            run = Path(a.run)
            audit.record(run.parent if run.name == "checkpoints" else run, _AUDITED[a.cmd], step=a.step if
                         hasattr(a, "step") else None, **({"out": a.out} if getattr(a, "out", None) else {}),
                         **({"to": a.to} if getattr(a, "to", None) else {}),
                         **({"format": a.format} if a.cmd == "export" else {}))
        return rc
    except (Refused, FileNotFoundError, FileExistsError, ckpt_layout.CheckpointCorruptError, ValueError) as exc:
        print(f"xirang-ckpt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
