"""A hook body to a plan: tracing with torch.fx into the IR (every "cannot compile" error), the IR, reductions over
dimensions, and plans (passes, bytes, launches)."""
