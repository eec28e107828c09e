"""fusedhooks: PyTorch gradient hooks compiled into one fused, in-place Triton kernel per gradient."""

from .adaptive import AdaptiveClip, adaptive_clip
from .agc import UnitwiseClip, agc
from .api import GradHook, RegistrationHandle, grad_hook
from .clip import clip_grad_norm_
from .distributed import LocalGradientWarning
from .ir import STAT_NAMES
from .plan import Plan
from .stats import HookStats
from .trace import CompileError, supported_ops
from .zclip import ZClip, zclip

# Importing fusedhooks must not import triton (TRITON_INTERPRET is read when triton is first imported).
__all__ = ["AdaptiveClip", "CompileError", "GradHook", "HookStats", "LocalGradientWarning", "Plan",
           "RegistrationHandle", "STAT_NAMES", "UnitwiseClip", "ZClip", "adaptive_clip", "agc", "clip_grad_norm_",
           "grad_hook", "supported_ops", "zclip"]
__version__ = "0.1.0"
