"""The firing: the one sequence of what a firing reads and writes (`sequence`), the eager dispatch of one gradient,
end-of-backward buckets, FSDP2 shards, the firing while torch.compile traces (`traced`, the operators of `ops`) and
GradScaler's books (`amp`)."""
