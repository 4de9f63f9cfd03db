"""What a checkpoint is and what it computes: config, loading, tokenizer, the Ouro network and its kernels,
the exit gate's readout. Running it over scheduled batches is the step runner's business (runner/)."""
