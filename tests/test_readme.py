"""The README's commands, run as written."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_hf_roundtrip import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def readme_block(heading: str) -> str:
    """The first ```bash block under ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    assert heading in text, f"no heading {heading!r} in README.md"
    m = re.search(r"```bash\n(.*?)```", text.split(heading, 1)[1], flags=re.S)
    assert m, f"no bash block under {heading}"
    return m.group(1)


def chats(path: Path, n: int = 400) -> None:
    """Conversations as users bring them: a system prompt, a question, the reply to learn."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            msgs = [{"role": "system", "content": "You add numbers."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
            f.write(json.dumps({"messages": msgs}) + "\n")


@pytest.mark.slow
def test_readme_fine_tuning(tmp_path: Path) -> None:
    model_dir, corpus = tmp_path / "my-llama", tmp_path / "chats.jsonl"
    make_model_dir(model_dir)
    chats(corpus)
    env = {**os.environ, "MODEL": str(model_dir), "CHATS": str(corpus),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", readme_block("## Fine-tuning")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "0 longer than model.seq_len+1=257" in out  # every conversation fits the window whole
    assert "step    30/30" in out and "lora: " in out
    assert re.search(r"harness: xirang_heldout_mc acc \d\.\d+", out)
    run = tmp_path / "runs" / "chat"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (run / "adapter").iterdir()}
    assert json.loads((run / "harness.json").read_text())
    assert any(line.startswith("reply: ") for line in r.stdout.splitlines())  # the served run answered the client


@pytest.mark.slow
def test_readme_plan_from_a_target(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", readme_block("## Plan from a target")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    # The first plan is the one the comment describes.
    assert "12.8B parameters" in out and "260B tokens" in out and "on 4 node(s)" in out and "15.4 days" in out
    assert "xirang-train -m train.name=scaling" in out  # the sweep to run
    plan = (tmp_path / "plan.txt").read_text()
    steps = int(re.search(r"train.max_steps=(\d+)", plan).group(1))
    # The launched run is the planned one, trained to its last step.
    cfg = json.loads((tmp_path / "runs" / "planned" / "config.json").read_text())["config"]
    assert cfg["train"]["max_steps"] == steps and cfg["model"]["name"] in plan
    assert f"step   {steps}/{steps}" in out or f"{steps} of {steps} steps" in out


def test_readme_models_presets_exist() -> None:
    """Every preset the "Models" section names is a config file ``model=`` composes."""
    text = (ROOT / "README.md").read_text().split("## Models", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"`([a-z0-9.\-]+)`", text.split("Presets with published", 1)[1])
    assert len(names) == 8
    for name in names:
        assert (ROOT / "conf" / "model" / f"{name}.yaml").is_file(), name
