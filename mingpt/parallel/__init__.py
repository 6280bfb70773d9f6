"""How the model is spread over the processes: DDP and FSDP wrapping, compilation, gradient clipping and the
model's and optimizer's state in the form each strategy saves and loads (data_parallel); the opt-in shared-memory
all-reduce for one CPU node (shm_allreduce)."""
