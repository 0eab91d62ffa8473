"""The layout algebra and planning: pure, numpy only, no transport.

Only ``jreshard.sharding.jax`` imports jax.
"""
