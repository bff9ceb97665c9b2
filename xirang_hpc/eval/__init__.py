"""xirang_hpc.eval: held-out loss, perplexity and a generation sample of a checkpoint."""
