"""What a checkpoint is and how it runs: config, loading, tokenizer, the Ouro network, the runner."""
