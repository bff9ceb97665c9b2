"""Load test of xirang-serve: N concurrent clients send M completion requests to three servers in one
run, on the same weights: ours (continuous batching, ``--max-batch 32``, ``POST /v1/completions``), the
baseline (the same server decoding one request at a time, ``--max-batch 1``) and a Hugging Face peer
(the weights exported with ``xirang-ckpt export --format hf``, served by transformers ``generate``
batched by a plain aiohttp server, benchmarks/hf_generate_server.py). Prints p50/p99 latency,
throughput, errors and the ratios.

    python benchmarks/bench_serve.py [--rounds 7] [--clients 32] [--requests 200] [--max-tokens 32] [--source RUN_DIR]

The three servers start once and stay up; the load then visits them in turns, ``--rounds`` times, the order
rotated every round (ours, HF, baseline; HF, baseline, ours; ...), so that a drift of the machine's load during
the run falls on every server alike. Each round gives one paired ratio per peer (ours/peer, measured minutes
apart); the headline is the median of those ratios, not a ratio of medians. Idle servers wait on a socket and
take no CPU while another is measured.

Without ``--source`` the weights are a fresh ``model=tiny`` preset, written as our safetensors export
and as the Hugging Face directory ``export --format hf`` writes (same conversion functions); with a
run directory the Hugging Face directory comes from ``xirang-ckpt export RUN --format hf`` itself.
Prompts are 4 to (context - max_tokens) bytes, so no sequence outgrows the model's context
(transformers' GPT-2 has no sliding window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import save_file

BIN = Path(sys.executable).parent


def make_weights(tmp: Path) -> Path:
    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT

    cfg = ModelConfig(name="tiny", n_layer=4, n_head=4, d_model=64, d_ff=256, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    path = tmp / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    import dataclasses

    (tmp / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg)}))
    return path


def hf_dir_for(source: Path, tmp: Path) -> Path:
    """The Hugging Face directory of ``source``: ``xirang-ckpt export --format hf`` for a run directory;
    for safetensors weights, the same conversion (``to_hf_state`` + ``hf_config_for``) applied directly."""
    out = tmp / "hf"
    if not str(source).endswith(".safetensors"):
        subprocess.run([str(BIN / "xirang-ckpt"), "export", str(source), "--format", "hf", "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        return out
    from xirang_hpc.weights.hf import hf_config_for, to_hf_state, write_hf_weights
    from xirang_hpc.weights.load import load_any

    loaded = load_any(source)
    out.mkdir(mode=0o700)
    write_hf_weights(to_hf_state(loaded.model.state_dict(), loaded.cfg), out, 5 * 2**30)
    (out / "config.json").write_text(json.dumps(hf_config_for(loaded.cfg, torch.float32), indent=1))
    return out


def context_of(source: Path) -> int:
    from xirang_hpc.weights.load import load_any

    return load_any(source).cfg.seq_len


def start(source: Path, info: Path, max_batch: int, threads: int, hf: bool = False) -> subprocess.Popen:
    env = {**os.environ, "XIRANG_SERVE_TOKEN": ""}
    cmd = ([sys.executable, str(Path(__file__).parent / "hf_generate_server.py")] if hf
           else [str(BIN / "xirang-serve")])
    proc = subprocess.Popen([*cmd, str(source), "--port", "0", "--info-file", str(info),
                             "--max-batch", str(max_batch), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    while not info.exists():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError("server did not start")
        time.sleep(0.1)
    return proc


async def load(url: str, clients: int, n_requests: int, max_tokens: int, max_prompt: int,
               model: str | None) -> dict[str, float]:
    """Drive one server: ``model`` set = ours (``/v1/completions``), None = the HF peer (``/generate``)."""
    text = Path(__file__).read_text()
    rng = random.Random(0)
    bodies = []
    for i in range(n_requests):  # the same prompts and lengths for every server (ASCII: bytes = characters)
        start_ = rng.randrange(0, len(text) - max_prompt)
        bodies.append({"prompt": text[start_: start_ + rng.randrange(4, max_prompt + 1)], "max_tokens": max_tokens,
                       "temperature": 0.8, "top_k": 40, "seed": i, **({"model": model} if model else {})})
    path = "/v1/completions" if model else "/generate"
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    lat: list[float] = []
    errors: list[str] = []
    tokens = [0]

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            try:
                async with session.post(f"{url}{path}", json=body) as r:
                    out = await r.json()
                    if r.status != 200:
                        errors.append(f"{r.status}: {out}")
                        continue
                    tokens[0] += out["usage"]["completion_tokens"] if model else out["completion_tokens"]
            except Exception as exc:  # noqa: BLE001 - counted as an error
                errors.append(repr(exc))
                continue
            lat.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    return {"ok": len(lat), "errors": len(errors), "wall_s": wall, "p50_s": statistics.median(lat), "p99_s": q[98],
            "req_per_s": len(lat) / wall, "tok_per_s": tokens[0] / wall, "first_error": errors[0] if errors else ""}


class Server:
    """One server of the comparison, started once and measured in every round."""

    def __init__(self, source: Path, tmp: Path, name: str, max_batch: int, threads: int, hf: bool = False) -> None:
        self.name, self.hf = name, hf
        self.proc = start(source, tmp / f"{name}.json", max_batch, threads, hf)
        started = json.loads((tmp / f"{name}.json").read_text())
        self.url, self.model = started["url"], None if hf else started["model"]

    def probe(self) -> str:
        """The greedy reply to a fixed prompt (ours and HF compute the same maths: the same text)."""
        body = {"prompt": "def ", "max_tokens": 16, "temperature": 0, **({} if self.hf else {"model": self.model})}
        with urllib_open(f"{self.url}{'/generate' if self.hf else '/v1/completions'}", body) as out:
            return out["text"] if self.hf else out["choices"][0]["text"]

    def measure(self, a: argparse.Namespace, max_prompt: int) -> dict[str, float]:
        """One round of load on this server, with its mean batch over the round."""
        before = self._batches()
        res = asyncio.run(load(self.url, a.clients, a.requests, a.max_tokens, max_prompt, self.model))
        after = self._batches()
        res["mean_batch"] = (after[0] - before[0]) / max(1, after[1] - before[1])
        return res

    def _batches(self) -> tuple[int, int]:
        """(rows, batches) so far: requests per generate call (HF), rows per forward pass (ours)."""
        if self.hf:
            with urllib_open(f"{self.url}/stats") as stats:
                return stats["rows"], stats["batches"]
        with urllib_open(f"{self.url}/v1/model") as stats:
            return stats["stats"]["batched_rows"], stats["stats"]["forward_passes"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


class urllib_open:  # noqa: N801 - tiny context manager around urllib for one JSON GET (or POST with body)
    def __init__(self, url: str, body: dict | None = None) -> None:
        self.url, self.body = url, body

    def __enter__(self) -> dict:
        import urllib.request

        data = json.dumps(self.body).encode() if self.body is not None else None
        req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="turns of load over the servers (paired ratios per round)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=200, help="requests per server per round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (xirang-serve --threads)")
    p.add_argument("--source", default=None, help="run dir or .safetensors to serve (default: fresh tiny preset)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers peer")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    ours, base, hf = "ours (batched)", "baseline (one at a time)", "HF transformers generate"
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        source = Path(a.source) if a.source else make_weights(tmp)
        max_prompt = min(47, context_of(source) - a.max_tokens)
        if max_prompt < 4:
            raise SystemExit(f"--max-tokens {a.max_tokens} leaves no room for a prompt in the model's context")
        servers: dict[str, Server] = {}
        try:
            servers[ours] = Server(source, tmp, "ours", a.max_batch, a.threads)
            servers[base] = Server(source, tmp, "base", 1, a.threads)
            if not a.no_hf:
                servers[hf] = Server(hf_dir_for(source, tmp), tmp, "hf", a.max_batch, a.threads, hf=True)
            probes = {name: s.probe() for name, s in servers.items()}
            names = list(servers)
            for r in range(a.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                rounds.append({name: servers[name].measure(a, max_prompt) for name in order})
                line = "  ".join(f"{n.split()[0]} {rounds[-1][n]['req_per_s']:.1f} req/s" for n in names)
                print(f"round {r + 1}/{a.rounds} ({', '.join(n.split()[0] for n in order)}): {line}", flush=True)
        finally:
            for s in servers.values():
                s.stop()
    print(f"{a.clients} clients, {a.requests} requests per server per round, {a.rounds} rounds, prompts "
          f"4-{max_prompt} bytes, {a.max_tokens} new tokens each, server torch threads {a.threads}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'server (median of rounds)':<26} {'ok':>5} {'err':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} "
          f"{'tok/s':>8} {'batch':>6}")
    med = statistics.median
    for name in names:
        rs = [rd[name] for rd in rounds]
        print(f"{name:<26} {sum(r['ok'] for r in rs):>5} {sum(r['errors'] for r in rs):>4} "
              f"{1e3 * med(r['p50_s'] for r in rs):>8.1f} {1e3 * med(r['p99_s'] for r in rs):>8.1f} "
              f"{med(r['req_per_s'] for r in rs):>7.1f} {med(r['tok_per_s'] for r in rs):>8.0f} "
              f"{med(r['mean_batch'] for r in rs):>6.1f}")
        first = next((r["first_error"] for r in rs if r["errors"]), "")
        if first:
            print(f"  first error: {first}")
    if hf in probes:
        print(f"greedy probe (prompt 'def ', 16 tokens): HF text == ours: {probes[hf] == probes[ours]}")
    summary: dict[str, dict[str, float | list[float]]] = {}
    for peer in names[1:]:
        thr = [rd[ours]["req_per_s"] / rd[peer]["req_per_s"] for rd in rounds]
        p50 = [rd[ours]["p50_s"] / rd[peer]["p50_s"] for rd in rounds]
        p99 = [rd[ours]["p99_s"] / rd[peer]["p99_s"] for rd in rounds]
        summary[peer] = {"throughput": med(thr), "p50": med(p50), "p99": med(p99), "throughput_per_round": thr}
        print(f"ours/{peer}, median of {len(thr)} paired rounds: throughput x{med(thr):.2f} "
              f"(rounds {min(thr):.2f}-{max(thr):.2f}), p50 latency x{med(p50):.2f}, p99 latency x{med(p99):.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": rounds, "paired": summary}, indent=1))
    if any(r["errors"] for rd in rounds for r in rd.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
