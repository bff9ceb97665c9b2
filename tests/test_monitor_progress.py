"""The training output: a progress line on a terminal (a real pty), the trainer's plain lines elsewhere.

The plain mode through a pipe is also what tests/test_e2e_local.py reads (``step    20/80 | loss``).
"""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xirang_hpc.runs.progress import CLEAR, PlainEcho, StepInfo, TerminalEcho, bar_text, make_echo, parse_step_line

# Exactly what Trainer.fit logs.
STEP = "step     4/10 | loss 3.2100 | grad norm 1.234 | 12,345 tok/s | ETA 0:00:12"


def test_step_line_parsed_and_rendered_as_a_bar() -> None:
    info = parse_step_line(STEP)
    assert info == StepInfo(step=4, total=10, loss=3.21, tokens_per_s=12345.0, eta="0:00:12")
    assert bar_text(info, width=10) == "[####......]  40.0%  step 4/10 | loss 3.2100 | 12,345 tok/s | ETA 0:00:12"
    for other in ("step     0/10 | val loss 5.5400", "model tiny: 0.21M params | 1 ranks", "stepping on",
                  "Traceback (most recent call last):"):
        assert parse_step_line(other) is None


def test_terminal_echo_redraws_one_line_and_prints_others_above_it() -> None:
    out = io.StringIO()
    e = TerminalEcho(out, width=10)
    e.line("model tiny: 0.21M params")
    e.line(STEP)
    e.line(STEP.replace("4/10", "8/10"))
    e.line("step     8/10 | val loss 2.0000")
    e.close()
    bar4 = bar_text(parse_step_line(STEP), 10)
    bar8 = bar_text(parse_step_line(STEP.replace("4/10", "8/10")), 10)
    assert out.getvalue() == ("model tiny: 0.21M params\n" + CLEAR + bar4 + CLEAR + bar8
                              + CLEAR + "step     8/10 | val loss 2.0000\n" + bar8 + "\n")


def test_plain_echo_when_not_a_terminal() -> None:
    out = io.StringIO()
    e = make_echo(out)
    assert type(e) is PlainEcho
    e.line(STEP)
    e.close()
    assert out.getvalue() == STEP + "\n"


def _read_pty(fd: int, proc: subprocess.Popen, timeout_s: float) -> str:
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_xirang_train_on_a_pty_shows_a_progress_line(tmp_path: Path, stdlib_data: Path) -> None:
    """A real 1-rank local run with its stdout on a pseudo-terminal."""
    exe = Path(sys.executable).parent / "xirang-train"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(exe), "cluster.nodes=1", "cluster.tasks_per_node=1", "train.max_steps=8", "train.log_every=2",
         "train.eval_batches=1", "train.warmup_steps=1", "parallel.pp=1", "parallel.tp=1",
         f"train.runs_root={tmp_path}/runs",
         f"data.out_dir={stdlib_data}"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        text = _read_pty(master, proc, 900)  # safety nets against a hang, not speed requirements
        assert proc.wait(timeout=300) == 0, text[-3000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = text.replace("\r\n", "\n")  # the pty's own newline translation
    bars = re.findall(r"\r\x1b\[K(\[[#.]+\]\s+[\d.]+%  step (\d+)/8 \| loss [\d.]+ \| [\d,]+ tok/s \| ETA \S+)", text)
    assert [int(s) for _, s in bars] == [2, 4, 6, 8], text[-3000:]
    assert "step     2/8 | loss" not in text  # the scrolling lines were replaced
    assert "step     0/8 | val loss" in text  # other lines still print
    # the bar's line is ended before the summary
    assert re.search(r"ETA \S+\n=+\ndone: 8 steps this session \(8 of 8 steps\) on 1 ranks", text), text[-3000:]
