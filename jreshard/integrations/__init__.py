"""Adapters that make RL stacks move their weights with jreshard.

- :mod:`jreshard.integrations.tunix`: a resharding backend for Google's Tunix
  (``pip install 'jreshard[tunix]'``);
- :mod:`jreshard.integrations.vllm`: vLLM's tensor-parallel parameter layouts (fused ``qkv_proj`` and
  ``gate_up_proj``, replicated key/value heads, padded vocabulary) as views of a trainer's tree.

Each adapter is imported on its own (``from jreshard.integrations import tunix``) and imports
its stack only when it is used.
"""
