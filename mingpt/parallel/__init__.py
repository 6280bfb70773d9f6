"""How the model is spread over the processes: the layout and its device mesh (layout), the one entry point and the
object the training loop drives for every layout (parallelize), the model's and optimizer's state in each layout's
snapshot form (state), tensor parallelism (tensor_parallel), and pipeline stages and schedules (pipeline)."""
