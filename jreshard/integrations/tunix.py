"""A resharding backend for Tunix: its weight syncs between the actor and rollout meshes move with jreshard.

Tunix (``google-tunix``, 0.1.7; ``pip install 'jreshard[tunix]'``) reshards through one entry point,
``tunix.rl.reshard.reshard_pytree(source, target, cache_plan=True, donate_input=False,
use_experimental_pre_reshard=True)``, which tries Pathways and otherwise calls ``jax.device_put``.
Every caller looks that attribute up when it runs: ``RLCluster.sync_weights`` (through the rollout's
``update_params``) and ``RLCluster`` loading a model onto another mesh, ``reshard_model_to_mesh``, and
the vLLM and SGLang-JAX samplers, which hand it to ``tunix.generate.utils.transfer_state_with_mappings``
/ ``transfer_state_directly`` as ``reshard_fn`` (called ``reshard_fn(tree, shardings)`` or
``reshard_fn(source=..., target=...)``).

:func:`install` replaces that one attribute with :func:`reshard_pytree` below, so all of those
reshard with :func:`jreshard.transfer`; :func:`uninstall` puts Tunix's function back. Nothing else is
changed: not jax, not Tunix's other modules.

**Guarantee.** ``reshard_pytree(source, target)`` returns what ``jax.device_put(source, shardings)``
returns, with ``shardings`` the target's shardings as Tunix computes them: the same tree, and per leaf
the same shape, dtype, sharding and bytes in every shard. Tunix's targets give shardings only, so
nothing is cast (a cast is ``jreshard.transfer(source, rollout_arrays)``: an array target of another
dtype casts).

**Supported.**

- Sources: pytrees Tunix passes (``nnx.State``, nested and flat dicts) of jax arrays, numpy arrays
  and Python scalars (placed by ``jax.device_put``, as Tunix's backend does).
- Targets: a pytree matching the source (or one sharding for every leaf) of ``Sharding``\\ s,
  ``jax.Array``\\ s (their sharding; deleted arrays too, as Tunix's ``delete_dst_buffers`` leaves
  them), ``jax.ShapeDtypeStruct``\\ s with a sharding, or ``None`` (the leaf is returned as it is).
- Memory kinds ``device``, ``pinned_host`` and ``unpinned_host`` (Tunix's offloading) in one process;
  across the processes of a cluster, device memory through jreshard's backends.
- Transfer guards: ``RLCluster.sync_weights`` runs under ``disallow_explicit`` host-to-device and
  device-to-host guards on CPU; jreshard moves device to device and is allowed there (on CPU, where
  ``jax.device_put`` between shardings of different devices goes through the host, it is not).
- ``donate_input=True``: every source array whose bytes moved is deleted after the move, as
  ``jax.device_put(..., donate=True)`` may do; a leaf returned as it is, is never deleted.
- ``cache_plan`` and ``use_experimental_pre_reshard`` are accepted and change nothing: jreshard's
  plans are always cached, keyed by everything they depend on (a cached plan is never stale), and the
  pre-reshard is a Pathways feature (Tunix's ``device_put`` backend ignores both too).

**Refused** (each with an exception that names the leaf and shows shapes, dtypes and shardings):
flags that are not booleans (``TypeError``), a target that does not match the source's structure
(``LayoutMismatchError``), a target leaf that is not a sharding, array, ShapeDtypeStruct or ``None``
(``LayoutError``), traced values inside ``jax.jit`` (``LayoutError``), host memory kinds across
processes (``TopologyError``). Pathways (``JAX_PLATFORMS=proxy``) is not a jreshard backend: there,
keep Tunix's own resharding (do not call :func:`install`).

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  >>> from jreshard.integrations import tunix as jt
  >>> devs = np.array(jax.devices())
  >>> actor = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
  >>> rollout = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
  >>> params = {"w": jax.device_put(jnp.arange(32.0).reshape(4, 8), actor)}
  >>> out = jt.reshard_pytree(source=params, target={"w": rollout})
  >>> out["w"].sharding == rollout, np.array_equal(out["w"], params["w"])
  (True, True)
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np

from jreshard.api import transfer
from jreshard.errors import BackendUnavailableError
from jreshard.types import PyTree, Sharding, Target

__all__ = ["install", "installed", "reshard_pytree", "uninstall"]

# Tunix's own function while this module's is installed (empty: not installed).
_ORIGINAL: list[Any] = []
_PARAMETERS = ("source", "target", "cache_plan", "donate_input", "use_experimental_pre_reshard")


def _target_sharding(t: Target) -> Sharding:
    """The sharding a Tunix target leaf asks for: a Sharding as it is, an array's or ShapeDtypeStruct's own."""
    if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) and not isinstance(t, jax.core.Tracer):
        return t.sharding  # (a deleted array keeps it; a ShapeDtypeStruct without one: the front door says so)
    return t  # a Sharding, or something the front door refuses by name


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"reshard_pytree: {name} must be a bool, got {type(value).__name__} {value!r}")


def reshard_pytree(
    source: PyTree,
    target: PyTree,
    cache_plan: bool = True,
    donate_input: bool = False,
    use_experimental_pre_reshard: bool = True,
) -> PyTree:
    """Tunix's ``reshard_pytree``, with jreshard moving the bytes: ``source`` onto ``target``'s shardings.

    Args:
      source: the pytree to move (jax arrays; numpy arrays and scalars are placed as ``device_put`` does).
      target: a pytree matching ``source`` (or one sharding) of shardings, arrays (their sharding),
        ShapeDtypeStructs with a sharding, or ``None`` (keep the leaf).
      cache_plan: accepted for Tunix's signature; jreshard always caches its plans (module docstring).
      donate_input: delete every source array whose bytes moved, once they have.
      use_experimental_pre_reshard: accepted for Tunix's signature (a Pathways feature).

    Returns:
      What ``jax.device_put(source, shardings)`` returns: every leaf committed to its target's sharding.

    Raises:
      TypeError: a flag that is not a bool.
      LayoutMismatchError, LayoutError, IndivisibleError, TopologyError, BackendUnavailableError: as
        :func:`jreshard.transfer` (the message names the leaf).
    """
    for name, value in (
        ("cache_plan", cache_plan),
        ("donate_input", donate_input),
        ("use_experimental_pre_reshard", use_experimental_pre_reshard),
    ):
        _check_flag(name, value)
    shardings = target
    if not isinstance(target, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(
            _target_sharding, target, is_leaf=lambda v: isinstance(v, (jax.Array, jax.ShapeDtypeStruct))
        )
    result = transfer(source, shardings)
    if donate_input:
        returned = {id(v) for v in jax.tree_util.tree_leaves(result)}
        for v in jax.tree_util.tree_leaves(source):
            if isinstance(v, jax.Array) and id(v) not in returned and not v.is_deleted():
                v.delete()
    return result


def _tunix_reshard() -> Any:
    """Tunix's resharding module.

    Raises:
      BackendUnavailableError: Tunix is not installed, or its entry point is not the one this adapter serves.
    """
    try:
        from tunix.rl import reshard
    except ImportError as err:
        raise BackendUnavailableError(
            f"jreshard.integrations.tunix needs Tunix ({err}); the fix is pip install 'jreshard[tunix]'"
        ) from err
    return reshard


def installed() -> bool:
    """Whether Tunix's ``reshard_pytree`` is this module's (False also where Tunix is not installed)."""
    try:
        return _tunix_reshard().reshard_pytree is reshard_pytree
    except BackendUnavailableError:
        return False


def install() -> None:
    """Make Tunix reshard with jreshard everywhere it reshards (module docstring); calling it again does nothing.

    Raises:
      BackendUnavailableError: Tunix is not installed, or its ``reshard_pytree`` does not take the
        parameters this adapter serves (another Tunix release: the message shows them).
    """
    reshard = _tunix_reshard()
    current = reshard.reshard_pytree
    if current is reshard_pytree:
        return
    params = tuple(inspect.signature(current).parameters)
    if params != _PARAMETERS:
        raise BackendUnavailableError(
            f"tunix.rl.reshard.reshard_pytree takes {params}; jreshard.integrations.tunix serves {_PARAMETERS} "
            "(google-tunix 0.1.7): the fix is pip install 'jreshard[tunix]'"
        )
    _ORIGINAL[:] = [current]
    reshard.reshard_pytree = reshard_pytree


def uninstall() -> bool:
    """Put Tunix's own ``reshard_pytree`` back; returns whether it was this module's until now.

    Raises:
      BackendUnavailableError: Tunix is not installed.
    """
    reshard = _tunix_reshard()
    if reshard.reshard_pytree is not reshard_pytree or not _ORIGINAL:
        return False
    reshard.reshard_pytree = _ORIGINAL.pop()
    return True
