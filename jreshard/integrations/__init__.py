"""Adapters that make RL stacks move their weights with jreshard.

- :mod:`jreshard.integrations.tunix`: a resharding backend for Google's Tunix
  (``pip install 'jreshard[tunix]'``).

Each adapter is imported on its own (``from jreshard.integrations import tunix``) and imports
its stack only when it is used.
"""
