"""Step execution: turns a ScheduledBatch into tensors, runs the model's loops over it through one loop
driver (eagerly, or by replaying CUDA graphs of whole steps or of single loops), reads out and samples.

It sits above the model, the attention backends and the KV cache, and below the Engine; it never imports the
scheduler (the batch it runs is a request.ScheduledBatch).
"""
