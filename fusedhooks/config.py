"""Every environment variable fusedhooks reads, read here and nowhere else (tests/test_config.py checks it).

Each is read when it is needed, not at import (a launch already bound keeps what it read):

| variable | read by | value |
| --- | --- | --- |
| `TRITON_INTERPRET` | `triton_interpret()` | not `""`/`"0"`: Triton kernels run in the CPU interpreter |
| `FUSEDHOOKS_BACKEND` | `backend()` | `auto`, `triton`, `eager` or `reference` (another name is refused when used) |
| `FUSEDHOOKS_BLOCK` | `block()` | elements per program, a power of two >= 16 (else refused) |
| `FUSEDHOOKS_FAST_LAUNCH` | `fast_launch()` | `1`/`true`/`on`/`yes` (default) or `0`/`false`/`off`/`no`/empty |
| `FUSEDHOOKS_CACHE_DIR` | `cache_dir()` | the generated kernels' directory (default: `XDG_CACHE_HOME`/fusedhooks) |
| `XDG_CACHE_HOME` | `cache_dir()` | default `~/.cache` |
| `FUSEDHOOKS_TUNE_CACHE` | `tune_cache()` | the tuning file (default: `cache_dir()/tuning.json`) |

The command line sets `TRITON_INTERPRET` (for Triton) and `FUSEDHOOKS_TUNE_CACHE` (`tune --out`) before the
kernels are compiled; setting a variable is not reading it.
"""

from __future__ import annotations

import os
from pathlib import Path


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend() -> str | None:
    """FUSEDHOOKS_BACKEND as set (None when unset or empty); runtime.choose_backend checks the name."""
    return os.environ.get("FUSEDHOOKS_BACKEND") or None


def block() -> int | None:
    """FUSEDHOOKS_BLOCK (None when unset or empty); ValueError unless it is a power of two >= 16."""
    value = os.environ.get("FUSEDHOOKS_BLOCK")
    if not value:
        return None
    try:
        elements = int(value)
    except ValueError:
        elements = 0  # refused below
    if elements < 16 or elements & (elements - 1):
        raise ValueError(f"FUSEDHOOKS_BLOCK must be a power of two >= 16, not {value!r}")
    return elements


def fast_launch() -> bool:
    """FUSEDHOOKS_FAST_LAUNCH (default on; see fastlaunch.py); ValueError for a spelling of neither."""
    value = os.environ.get("FUSEDHOOKS_FAST_LAUNCH", "1").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("", "0", "false", "off", "no"):
        return False
    raise ValueError(f"FUSEDHOOKS_FAST_LAUNCH={value!r}: set it to 1 (the default: launch through the bound "
                     "launcher) or 0 (every launch through kernel[grid])")


def cache_dir() -> Path:
    """FUSEDHOOKS_CACHE_DIR, else $XDG_CACHE_HOME/fusedhooks, else ~/.cache/fusedhooks (an empty variable counts
    as unset)."""
    env = os.environ.get("FUSEDHOOKS_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusedhooks"


def tune_cache() -> Path:
    """FUSEDHOOKS_TUNE_CACHE, else tuning.json in the kernel cache directory."""
    env = os.environ.get("FUSEDHOOKS_TUNE_CACHE")
    return Path(env) if env else cache_dir() / "tuning.json"
