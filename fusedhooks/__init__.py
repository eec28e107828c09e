"""fusedhooks: PyTorch gradient hooks compiled into one fused, in-place Triton kernel per gradient."""

from .api import GradHook, RegistrationHandle, grad_hook
from .clipping.adaptive import AdaptiveClip, adaptive_clip
from .clipping.agc import UnitwiseClip, agc
from .clipping.clip import clip_grad_norm_
from .clipping.zclip import ZClip, zclip
from .compiler.ir import STAT_NAMES
from .compiler.plan import Plan
from .compiler.trace import CompileError, supported_ops
from .optim import SGD, AdamW
from .runtime.process_groups import LocalGradientWarning
from .stats.buffer import HookStats

# Importing fusedhooks must not import triton (TRITON_INTERPRET is read when triton is first imported).
__all__ = ["AdamW", "AdaptiveClip", "CompileError", "GradHook", "HookStats", "LocalGradientWarning", "Plan",
           "RegistrationHandle", "SGD", "STAT_NAMES", "UnitwiseClip", "ZClip", "adaptive_clip", "agc",
           "clip_grad_norm_", "grad_hook", "supported_ops", "zclip"]
__version__ = "0.1.0"
