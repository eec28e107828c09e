"""fusedhooks: PyTorch gradient hooks compiled into one fused, in-place Triton kernel per gradient."""

from .api import GradHook, RegistrationHandle, grad_hook
from .ir import STAT_NAMES
from .plan import Plan
from .stats import HookStats
from .trace import CompileError, supported_ops

__all__ = ["CompileError", "GradHook", "HookStats", "Plan", "RegistrationHandle", "STAT_NAMES", "grad_hook",
           "supported_ops"]
__version__ = "0.1.0"
