"""Registration: what `register()` checks and registers (tensors, modules, iterables, FSDP2-sharded parameters, DDP
models through their communication hook), and the gates of `accumulation_steps=` and `when=`."""
