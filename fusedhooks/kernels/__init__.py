"""Hand-written Triton helpers that generated hook kernels call (installed as `fusedhooks.kernels`)."""
