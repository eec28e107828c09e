"""Statistics: the device buffer of a hook's rows and its readers, what a backward is (rows are numbered per backward),
and the merge of sharded parameters' partials."""
