"""Rendezvous: how the processes of a group agree on one small value (the NCCL
unique id) before they share a communicator.

Exactly one process makes the value; every process of the group calls
:meth:`Rendezvous.share` with the same key and gets it back. Implementations:

- :class:`KeyValueRendezvous`: the key-value store of a ``jax.distributed``
  cluster (or any client with the same two calls), when every process is in one
  JAX cluster;
- :class:`jreshard.mpi.rendezvous.MpiRendezvous`: an exchange over an mpi4py communicator, bounded by
  ``timeout_s``, when the processes were launched under MPI (with the MPI transport: one transport never
  imports another);
- a ``RefitGroup`` supplies its own over the address the group was formed at.

These move a few hundred bytes once per communicator; they are not a data path.
"""

from __future__ import annotations

from typing import Any

from jreshard.engine.comm import Rendezvous
from jreshard.errors import BackendUnavailableError, TransferTimeoutError

__all__ = ["KeyValueRendezvous", "Rendezvous"]


class _LocalStore:
    """A key-value store in this process (the client interface of ``jax.distributed``'s store)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        self.values[key] = value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self.values[key]


class KeyValueRendezvous(Rendezvous):
    """Over a key-value store: the maker sets the key, the others wait for it (final).

    Args:
      client: has ``key_value_set(key: str, value: str)`` and
        ``blocking_key_value_get(key: str, timeout_in_ms: int) -> str``, as the
        ``jax.distributed`` runtime client does.
      namespace: prefixed to every key, so two groups in one cluster never meet.

    Example:
      >>> class Store:
      ...     def __init__(self): self.d = {}
      ...     def key_value_set(self, k, v): self.d[k] = v
      ...     def blocking_key_value_get(self, k, timeout_in_ms): return self.d[k]
      >>> store = Store()
      >>> KeyValueRendezvous(store).share("uid/0", b"\\x01\\xff", timeout_s=1.0)
      b'\\x01\\xff'
      >>> KeyValueRendezvous(store).share("uid/0", None, timeout_s=1.0)
      b'\\x01\\xff'
    """

    __slots__ = ("_client", "_namespace")

    def __init__(self, client: Any, *, namespace: str = "jreshard"):
        self._client = client
        self._namespace = namespace

    @classmethod
    def in_process(cls, *, namespace: str = "jreshard") -> KeyValueRendezvous:
        """Over a store of this process's own: the rendezvous when one process drives every rank.

        >>> KeyValueRendezvous.in_process().share("uid/0", b"\\x02", timeout_s=1.0)
        b'\\x02'
        """
        return cls(_LocalStore(), namespace=namespace)

    @classmethod
    def from_jax(cls, *, namespace: str = "jreshard") -> KeyValueRendezvous:
        """The key-value store of this process's ``jax.distributed`` cluster.

        Raises:
          BackendUnavailableError: ``jax.distributed.initialize()`` has not run.
        """
        from jax._src import distributed  # the client has no public accessor in jax 0.10/0.11

        client = distributed.global_state.client
        if client is None:
            raise BackendUnavailableError(
                "KeyValueRendezvous.from_jax: this process is not in a jax.distributed cluster; "
                "the fix is to call jax.distributed.initialize(...) first, or to use MpiRendezvous under mpiexec"
            )
        return cls(client, namespace=namespace)

    def share(self, key: str, value: bytes | None, *, timeout_s: float) -> bytes:
        full = f"{self._namespace}/{key}"
        if value is not None:
            self._client.key_value_set(full, bytes(value).hex())
            return bytes(value)
        try:
            text = self._client.blocking_key_value_get(full, int(timeout_s * 1000))
        except Exception as err:  # the runtime raises its own error type on a deadline
            raise TransferTimeoutError(
                f"rendezvous: key {full!r} was not set within timeout_s={timeout_s}; the process that makes "
                f"the NCCL unique id did not reach this point ({type(err).__name__}: {err})",
                destination_intact=True,
            ) from err
        return bytes.fromhex(text)
