"""Training output for a terminal: one progress line updated in place, other lines scroll above it.

``xirang-train`` echoes rank 0's log (:func:`xirang_hpc.cli.train._follow`). On a terminal
the trainer's step lines (``step N/M | loss L | grad norm G | T tok/s | ETA H:MM:SS``) become a
single bar redrawn with ``\\r``; every other line (model summary, validation loss, errors) is
printed normally above the bar. Anywhere else (Slurm logs, pipes, tests) lines pass through
unchanged: :func:`make_echo` picks the mode from ``isatty()``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TextIO

from xirang_hpc.runs.render import progress

# The trainer's log line (runtime/trainer.py, Trainer.fit).
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \| loss ([-+\d.eE]+|nan|inf) \| grad norm \S+ \| ([\d,]+) tok/s"
                       r" \| ETA (\S+)\s*$")
CLEAR = "\r\033[K"  # carriage return + erase to end of line


@dataclass(frozen=True)
class StepInfo:
    """One parsed step line."""

    step: int
    total: int
    loss: float
    tokens_per_s: float
    eta: str


def parse_step_line(line: str) -> StepInfo | None:
    """The step line's fields, or None for any other line."""
    m = STEP_LINE.match(line.strip())
    if m is None:
        return None
    return StepInfo(int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4).replace(",", "")),
                    m.group(5))


def bar_text(info: StepInfo, width: int = 24) -> str:
    """``[####....]  40.0%  step 4/10 | loss 3.2100 | 1,234 tok/s | ETA 0:00:12``."""
    return (f"{progress(info.step, info.total, tty=True, width=width)} | loss {info.loss:.4f} | "
            f"{info.tokens_per_s:,.0f} tok/s | ETA {info.eta}")


class PlainEcho:
    """Lines unchanged (not a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def line(self, text: str) -> None:
        """Echo one log line."""
        self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """Nothing to finish."""


class TerminalEcho(PlainEcho):
    """Step lines redraw one bar in place; other lines are printed above it."""

    def __init__(self, out: TextIO, width: int = 24) -> None:
        super().__init__(out)
        self.width = width
        self.bar: str | None = None

    def line(self, text: str) -> None:
        """Echo one log line (see the class docstring)."""
        info = parse_step_line(text)
        if info is not None:
            self.bar = bar_text(info, self.width)
            self.out.write(CLEAR + self.bar)
        else:
            if self.bar is not None:
                self.out.write(CLEAR)
            self.out.write(text + "\n")
            if self.bar is not None:
                self.out.write(self.bar)
        self.out.flush()

    def close(self) -> None:
        """End the bar's line, so what follows starts on a fresh one."""
        if self.bar is not None:
            self.out.write("\n")
            self.out.flush()
            self.bar = None


def make_echo(out: TextIO) -> PlainEcho:
    """A :class:`TerminalEcho` when ``out`` is a terminal, else a :class:`PlainEcho`."""
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        tty = False
    return TerminalEcho(out) if tty else PlainEcho(out)
