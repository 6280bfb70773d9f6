"""How the model is spread over the processes: the layout and its device mesh (layout), DDP and FSDP wrapping with
each strategy's state (data_parallel), tensor parallelism (tensor_parallel), pipeline stages and schedules
(pipeline), and the model on a mesh (hybrid)."""
