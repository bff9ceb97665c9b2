"""The loop seam (runtime/hooks.py ``Loop``): the trainer offers every member hooks are written against, and no
hook reaches past it (private trainer members, attributes the seam does not name)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import torch.distributed as dist
from parallel_harness import make_cfg, topology

from xirang_hpc.runtime.hooks import Loop, LoopState
from xirang_hpc.runtime.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1] / "xirang_hpc"
HOOK_FILES = ["checkpoint/trainer_hook.py", "checkpoint/state.py", "monitor/trainer_hook.py", "monitor/tracking.py",
              "monitor/goodput_hook.py", "runtime/signals.py", "runtime/comm/install.py",
              "weights/load.py"]


def test_the_trainer_is_a_loop(stdlib_data: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        trainer = Trainer(make_cfg(1, {}), topology(0, 1, port), tmp_path, stdlib_data, log=lambda s: None)
        assert isinstance(trainer, Loop) and isinstance(trainer.state, LoopState)
        trainer.phase("data")
        trainer.request_stop()
        assert trainer.stop_requested
    finally:
        dist.destroy_process_group()


def test_hooks_use_only_what_the_seam_names() -> None:
    members = set(Loop.__annotations__) | {"phase", "request_stop"}
    used: dict[str, set[str]] = {}
    for rel in HOOK_FILES:
        text = (ROOT / rel).read_text()
        for name in re.findall(r"\btrainer\.([A-Za-z_]\w*)", text) + re.findall(r"getattr\(trainer, \"(\w+)\"", text):
            used.setdefault(name, set()).add(rel)
    beyond = {name: sorted(files) for name, files in used.items() if name not in members}
    assert not beyond, f"hooks reach past the Loop seam: {beyond}"
