"""The Hugging Face peer of benchmarks/bench_serve.py: transformers ``generate`` behind aiohttp, written
the way a user would write it.

Requests (``POST /generate`` with ``{"prompt", "max_tokens", "temperature", "top_k", "seed"}``) wait
in a queue; one worker takes everything waiting (up to ``--max-batch``), left-pads it and runs one
``model.generate`` for the whole batch in a thread (static batching: the batch runs until its
longest request is done; requests arriving meanwhile wait for the next batch). Byte-level tokens
(token i = byte i), as the benchmark's model was trained with.

    python benchmarks/hf_generate_server.py HF_DIR --port 0 --info-file hf.json [--max-batch 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--info-file", default=None)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir).eval()
    stats = {"batches": 0, "rows": 0}
    queue: asyncio.Queue[tuple[asyncio.Future, dict[str, Any]]] = asyncio.Queue()

    def run_batch(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids = [list(b["prompt"].encode()) for b in bodies]
        width = max(len(x) for x in ids)
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, x in enumerate(ids):  # left padding: every row's last prompt token is at the end
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        n = max(b["max_tokens"] for b in bodies)
        temp, top_k = float(bodies[0].get("temperature", 0.0)), int(bodies[0].get("top_k", 0))
        torch.manual_seed(int(bodies[0].get("seed", 0)))
        kw: dict[str, Any] = {"do_sample": True, "temperature": temp, "top_k": top_k or None} if temp > 0 else {
            "do_sample": False}
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0, **kw)
        new = out[:, width:].tolist()
        return [{"text": bytes(t & 0xFF for t in row[: b["max_tokens"]]).decode("utf-8", "replace"),
                 "completion_tokens": len(row[: b["max_tokens"]])} for row, b in zip(new, bodies)]

    async def worker(app: web.Application) -> Any:
        async def loop_() -> None:
            loop = asyncio.get_running_loop()
            while True:
                batch = [await queue.get()]
                while len(batch) < a.max_batch and not queue.empty():
                    batch.append(queue.get_nowait())
                try:
                    results = await loop.run_in_executor(None, run_batch, [b for _, b in batch])
                except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
                    for fut, _ in batch:
                        fut.set_exception(exc)
                    continue
                stats["batches"] += 1
                stats["rows"] += len(batch)
                for (fut, _), r in zip(batch, results):
                    fut.set_result(r)

        task = asyncio.create_task(loop_())
        yield
        task.cancel()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        fut = asyncio.get_running_loop().create_future()
        await queue.put((fut, body))
        try:
            return web.json_response(await fut)
        except Exception as exc:  # noqa: BLE001
            return web.json_response({"error": str(exc)}, status=500)

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application()
    app.cleanup_ctx.append(worker)
    app.router.add_post("/generate", generate)
    app.router.add_get("/stats", get_stats)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", a.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        if a.info_file:
            Path(a.info_file).write_text(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid()}))
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
