"""``xirang-serve PATH``: serve a checkpoint (any training layout) or exported safetensors over HTTP.

PATH is a run directory, its ``checkpoints`` directory, one ``step_N`` directory, or a
``.safetensors`` file with its JSON config. Binds 127.0.0.1 unless ``--host`` says otherwise;
set ``$XIRANG_SERVE_TOKEN`` (or the variable ``--token-env`` names) to require a bearer token.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ServeConfig
from xirang_hpc.config.schema.serve import SERVE_FILE
from xirang_hpc.files import private_by_default
from xirang_hpc.runtime.startup import collector_paused


def _parser() -> argparse.ArgumentParser:
    d = ServeConfig()
    from xirang_hpc.cli.help import argparse_texts

    p = argparse.ArgumentParser(prog="xirang-serve", **argparse_texts("xirang-serve"))  # type: ignore[arg-type]
    p.add_argument("path", help="run dir, checkpoints dir, step_N dir, or FILE.safetensors")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest that verifies)")
    p.add_argument("--host", default=d.host, help=f"bind address (default {d.host}; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=d.port, help=f"TCP port (default {d.port}; 0 = any free port)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="requests decoded together")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="0 = model.seq_len")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--token-env", default=d.token_env, help="env var holding the bearer token (unset = no auth)")
    p.add_argument("--keys-file", default=d.keys_file,
                   help="named API keys (JSON, mode 0600), each with the runs it may use")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    p.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0 = until interrupted)")
    p.add_argument("--info-file", default=None,
                   help=f"where to write url/port/pid JSON (default: <run dir>/{SERVE_FILE} for a run dir)")
    p.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s,
                   help="close a request whose headers/body have not arrived within this many seconds")
    p.add_argument("--model-name", default=d.model_name,
                   help="model id of the OpenAI-compatible API (default: the run directory's name)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="also serve this PEFT LoRA adapter over the model, as model NAME (repeatable)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    return p


def _quiet(line: str) -> None:
    """Requests stay out of the system log (the server's start and stop go there): one line per request would
    flood it; the run's audit trail keeps them."""


def _adapters(specs: list[str]) -> dict[str, str]:
    """``--adapter NAME=DIR`` flags as ``serve.adapters`` (a ConfigError names a malformed or repeated one)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in out:
            raise ConfigError("--adapter", spec, "give each adapter once as NAME=DIR (a PEFT adapter directory)")
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = _parser().parse_args(argv)
    private_by_default()  # the server's records are the user's own
    logging.basicConfig(level=logging.WARNING)
    # The serving stack (torch, the model, the weights readers) only now: --help and a usage error answer without it.
    # Imported with the garbage collector paused and then frozen (runtime/startup.py), as a rank's: the server's
    # later full collections skip those objects, which shortens their pauses between requests.
    with collector_paused():
        import torch

        from xirang_hpc.serve.run import check_exposure, serve
        from xirang_hpc.serve.server import Access
        from xirang_hpc.weights.load import WeightsError, load_any

    try:
        scfg = ServeConfig(host=args.host, port=args.port, max_batch=args.max_batch,
                           max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                           token_env=args.token_env, keys_file=args.keys_file,
                           metrics_public=args.metrics_public, duration_s=args.duration_s,
                           read_timeout_s=args.read_timeout_s, model_name=args.model_name,
                           adapters=_adapters(args.adapter))
        check_exposure(scfg, os.environ.get(scfg.token_env) or None if scfg.token_env else None)
        loaded = load_any(args.path, args.step)
    except (ConfigError, WeightsError, FileNotFoundError) as exc:
        print(f"xirang-serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    info = Path(args.info_file) if args.info_file else None
    run_dir = Path(args.path)
    if info is None and (run_dir / "checkpoints").is_dir():
        if os.access(run_dir, os.W_OK):
            info = run_dir / SERVE_FILE
        else:  # a run shared with us (train.share_group): read, never written
            print(f"xirang-serve: {run_dir} is not writable by you; no {SERVE_FILE} there (use --info-file)",
                  file=sys.stderr)
    from xirang_hpc.monitor import audit

    audited = run_dir if (run_dir / "checkpoints").is_dir() else None
    if audited is not None:
        audit.record(audited, "serve", host=scfg.host, port=scfg.port,
                     auth=bool(scfg.keys_file or os.environ.get(scfg.token_env)))

    def on_access(a: Access) -> None:
        """The access log (stdout, one line per request) and, for a run, its audit trail: the key's name only."""
        print(f"access {a.peer} {a.method} {a.path} {a.status} key={a.key or '-'}", flush=True)
        if audited is not None:
            audit.record(audited, "request", key=a.key, path=a.path, status=a.status, peer=a.peer,
                         to_syslog=_quiet)

    try:
        serve(loaded, scfg, info, log=lambda m: print(m, flush=True), on_access=on_access)
    except WeightsError as exc:  # a served adapter that does not fit the model, before anything listens
        print(f"xirang-serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        if audited is not None:
            audit.record(audited, "serve_stop")


if __name__ == "__main__":
    main()
