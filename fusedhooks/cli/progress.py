"""Progress of the long commands (`tune`, `build`, benchmarks/run.py) on stderr: a tqdm bar where tqdm (an optional
extra) is installed and stderr is a terminal, else one line per step."""

from __future__ import annotations

import sys


class Progress:
    """Reports `total` steps of `label`: `step(text)` after each one (text: what was done), `close()` at the end.

    bar=False: lines even where tqdm could draw a bar (e.g. several processes writing to one terminal)."""

    def __init__(self, total: int, label: str, bar: bool = True):
        self.total, self.label, self.done = total, label, 0
        self._bar = None
        if bar and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc=label, file=sys.stderr)

    def step(self, text: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update()
        else:
            print(f"{self.label} [{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
