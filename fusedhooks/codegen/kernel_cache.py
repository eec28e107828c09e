"""Loading generated source: each source is written once to the cache directory (config.cache_dir) by content hash
and imported as a module of @triton.jit kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile

from .. import config
from .launch_spec import LaunchSpec

_loaded: dict[str, object] = {}


def load(source: str, spec: LaunchSpec | None = None):
    """The module of @triton.jit kernels defined by `source`, written once to the cache directory by
    content hash; spec (from `generate_with_spec`) becomes its SPEC."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    if digest in _loaded:
        module = _loaded[digest]
        if spec is not None:
            module.SPEC = spec
        return module
    directory = config.cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"fusedhooks writes its generated kernels to {directory} (FUSEDHOOKS_CACHE_DIR, else "
                      f"$XDG_CACHE_HOME/fusedhooks or ~/.cache/fusedhooks), which cannot be made a directory: {e}. "
                      "Set FUSEDHOOKS_CACHE_DIR to a writable directory") from None
    path = directory / f"fh_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".py.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    module_name = f"fusedhooks_generated_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    module.DIGEST = digest  # names the kernels in the tuning cache
    module.SPEC = spec
    _loaded[digest] = module
    return module
