"""The tuning cache: launch configurations measured by `python -m fusedhooks tune`, read by the runtime.

One JSON file (FUSEDHOOKS_TUNE_CACHE, default <cache dir>/tuning.json):

    {"<device name> | triton <version>": {"<kernel digest>": {
        "block": 4096,                                   # one BLOCK for every size (statistics stay the same
        "sizes": {"2^20": {"num_warps": 8, "num_stages": 1}, ...},   # whether bucketed or not)
        "tried": [{"block": ..., "num_warps": ..., "num_stages": ..., "size": ..., "ms": ...}, ...]}}}

Keys: the device's name (CUDA: torch.cuda.get_device_name; CPU: the interpreter), the triton version and the
content hash of the generated kernel source, so a cache never applies to another GPU, triton or kernel.
Without an entry the runtime uses its heuristics.
"""

from __future__ import annotations

import json
import os
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from .. import config

_cache: dict | None = None
_device_keys: dict[torch.device, str] = {}


def device_key(device: torch.device) -> str:
    key = _device_keys.get(device)
    if key is None:
        try:
            triton_version = version("triton")
        except PackageNotFoundError:
            triton_version = "?"
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"
        key = _device_keys[device] = f"{name} | triton {triton_version}"
    return key


def size_key(numel: int) -> str:
    """Sizes are tuned and looked up by power of two (so every parameter shape does not retune)."""
    return f"2^{max(numel - 1, 1).bit_length()}"


_lookups: dict[tuple, dict | None] = {}


def load(reload: bool = False) -> dict:
    global _cache
    if _cache is None or reload:
        _cache = _read(config.tune_cache())
        _lookups.clear()
    return _cache


def _read(path: Path) -> dict:
    """The cache file's contents; an unreadable one (truncated, not a tuning cache) is left out with a warning: it
    only holds launch configurations, and the defaults give the same results."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        data = e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        why = data if isinstance(data, Exception) else "not a tuning cache"
        warnings.warn(f"fusedhooks: the tuning cache {path} cannot be read ({why}); the default launch "
                      "configurations are used. Delete it, or run `python -m fusedhooks tune` again", stacklevel=2)
        return {}
    return data


def lookup(module, device: torch.device) -> dict | None:
    """The tuned entry for the kernels of `module` (generated, with a DIGEST) on `device`, or None.
    Read at every launch: memoised per (kernels, device) until the cache is reloaded."""
    key = (getattr(module, "DIGEST", None), device)
    if key not in _lookups:
        _lookups[key] = None if key[0] is None else load().get(device_key(device), {}).get(key[0])
    return _lookups[key]


def store(device: torch.device, digest: str, entry: dict) -> Path:
    """Add or replace one kernel's entry in the cache file; returns its path."""
    path = config.tune_cache()
    data = _read(path)
    data.setdefault(device_key(device), {})[digest] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    load(reload=True)
    return path
