"""Clipping across gradients: the global-norm clip fed by the norms hooks recorded (`clip_grad_norm_`), its coefficient
folded into a fused optimizer, ZClip, AdaGC and AGC. Above the hook object: each takes or makes a GradHook."""
