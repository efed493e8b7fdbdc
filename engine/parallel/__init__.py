"""Tensor parallelism over torch.distributed: the layout of one rank's share of a model
(`shard`), the step broadcast from rank 0 (`channel`), and the shard processes (`workers`)."""
