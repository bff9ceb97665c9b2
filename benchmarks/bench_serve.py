"""Load test of xirang-serve: N concurrent clients send M generate requests; ours (continuous batching,
``--max-batch 32``) and the baseline (the same server decoding one request at a time, ``--max-batch 1``)
run side by side on the same weights. Prints p50/p99 latency, throughput, errors, and the ratios.

    python benchmarks/bench_serve.py [--clients 32] [--requests 500] [--max-tokens 32] [--source W.safetensors]

Without ``--source`` the weights are a fresh ``model=tiny`` preset exported to safetensors (the
serving cost does not depend on what the weights learned).
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


def start(source: Path, info: Path, max_batch: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "XIRANG_SERVE_TOKEN": ""}
    proc = subprocess.Popen([str(BIN / "xirang-serve"), str(source), "--port", "0", "--info-file", str(info),
                             "--max-batch", str(max_batch), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    while not info.exists():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError("server did not start")
        time.sleep(0.1)
    return proc


async def load(url: str, clients: int, n_requests: int, max_tokens: int) -> dict[str, float]:
    text = Path(__file__).read_text()
    rng = random.Random(0)
    bodies = []
    for i in range(n_requests):
        start_ = rng.randrange(0, len(text) - 48)
        bodies.append({"prompt": text[start_: start_ + rng.randrange(4, 48)], "max_tokens": max_tokens,
                       "temperature": 0.8, "top_k": 40, "seed": i})
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
                async with session.post(f"{url}/v1/generate", json=body) as r:
                    out = await r.json()
                    if r.status != 200:
                        errors.append(f"{r.status}: {out}")
                        continue
                    tokens[0] += out["completion_tokens"]
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


def run_one(source: Path, tmp: Path, name: str, max_batch: int, a: argparse.Namespace) -> dict[str, float]:
    info = tmp / f"{name}.json"
    proc = start(source, info, max_batch, a.threads)
    try:
        url = json.loads(info.read_text())["url"]
        res = asyncio.run(load(url, a.clients, a.requests, a.max_tokens))
        with urllib_open(f"{url}/v1/model") as stats:
            res["mean_batch"] = stats["stats"]["batched_rows"] / max(1, stats["stats"]["forward_passes"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return res


class urllib_open:  # noqa: N801 - tiny context manager around urllib for one JSON GET
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=30) as r:
            return json.loads(r.read())

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (xirang-serve --threads)")
    p.add_argument("--source", default=None, help="run dir or .safetensors to serve (default: fresh tiny preset)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        source = Path(a.source) if a.source else make_weights(tmp)
        rows = {"ours (batched)": run_one(source, tmp, "ours", a.max_batch, a),
                "baseline (one at a time)": run_one(source, tmp, "base", 1, a)}
    print(f"{a.clients} clients, {a.requests} requests, {a.max_tokens} new tokens each, server torch threads "
          f"{a.threads}, {os.cpu_count()} CPUs")
    print(f"{'server':<26} {'ok':>5} {'err':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} {'tok/s':>8} {'batch':>6}")
    for name, r in rows.items():
        print(f"{name:<26} {r['ok']:>5} {r['errors']:>4} {1e3 * r['p50_s']:>8.1f} {1e3 * r['p99_s']:>8.1f} "
              f"{r['req_per_s']:>7.1f} {r['tok_per_s']:>8.0f} {r['mean_batch']:>6.1f}")
        if r["errors"]:
            print(f"  first error: {r['first_error']}")
    o, b = rows["ours (batched)"], rows["baseline (one at a time)"]
    print(f"ratios ours/baseline: throughput x{o['req_per_s'] / b['req_per_s']:.2f}, "
          f"p50 latency x{o['p50_s'] / b['p50_s']:.2f}, p99 latency x{o['p99_s'] / b['p99_s']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if o["errors"] or b["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
