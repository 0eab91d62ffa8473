"""The NIXL transport: one-sided WRITE of registered DRAM (VRAM on GPUs) between processes on any hosts.

:class:`~jreshard.nixl.agent.NixlAgent` is a process's NIXL agent (its registrations and the peers
it knows); :class:`~jreshard.nixl.comm.NixlComm` is the engine's
:class:`~jreshard.engine.comm.Communicator` over it, with its metadata and descriptors carried on
authenticated control connections (:mod:`jreshard.net.channel`). Install: ``pip install --no-deps nixl-cu12``.
"""

from jreshard.nixl.agent import NixlAgent as NixlAgent
from jreshard.nixl.agent import import_nixl as import_nixl
from jreshard.nixl.comm import NixlComm as NixlComm

__all__ = ["NixlAgent", "NixlComm", "import_nixl"]
