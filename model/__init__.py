"""JAX/Flax: the Transformer family, noising, losses, training, decoding, checkpoints."""
