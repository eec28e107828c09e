"""Running a plan on a gradient: backend choice, launches and grids (`launcher`), the direct launch path, the tuning
cache, the eager CPU backend and the reference (CPU fallback and test oracle), memory layouts, a hook's compiled
kernels and workspaces, and process groups."""
