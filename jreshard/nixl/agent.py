"""NixlAgent: one process's NIXL agent, the memory it registered, the peers it knows, the notices it got.

**Registrations.** A buffer handed to the transport (a destination shard, a staging arena, a source
shard's DLPack view) is a view of some allocation, its *root* (the numpy or CuPy array that owns the
memory; a pool's lease, an array over a memoryview of a block, leads to the block). The root is
registered once, whole, and the registration is cached by ``(memory type, device, address, size)``;
every later buffer inside it reuses the registration (the engine's pools hand the same blocks out
again, destination shards and staging arenas alike, so a refit loop registers its buffers once).
A registration must not nest in another: NIXL finds the registration of a range by the nearest one that
starts at or before it, so one inside another hides the larger from every range that starts inside the
smaller and ends past it. A root found inside a registration already made (a view whose owner is not its
``base``, as jax's memory is) joins that registration instead, which lives until the last of its roots dies.
(The other way round, a root that holds registrations made before it, is registered whole beside them until
their roots die: the engine never makes one, and the agent logs it.)
When a root is garbage collected its registration is released at the next call (a
``weakref.finalize`` queues it; NIXL is not called from the collector), and
:meth:`NixlAgent.close` releases all of them.

**Peers.** The agent's metadata (its UCX addresses) is introduced to a peer over an authenticated
:class:`~jreshard.net.channel.Channel` (never through NIXL's own listener, which authenticates nothing);
a registration a peer has not yet seen travels as partial metadata with the descriptors that use
it. The remote keys of registered memory are therefore only ever sent to authenticated peers, and
only sealed (the channel encrypts every frame): someone who reads the wire does not learn them.

**Notifications.** A receive id is 63 random bits (``secrets``), and each is bound to the one agent
expected to write it: a notification from any other agent, or naming an id nobody waits on, is
ignored (logged), so a stranger that guesses nothing cannot complete a receive.

**Interfaces.** UCX's TCP transport listens on every network interface unless told otherwise. An
agent made for a ``host`` (an address of this host, not a wildcard) restricts it to that address's
interface (UCX's ``UCX_NET_DEVICES``, set only while the agent's UCX context is made): one made for
``127.0.0.1`` listens on loopback only. Shared-memory transports (same host) are unaffected.

**WRITEs given up.** A transfer handle released while its WRITE is still running does not stop it: UCX
cannot cancel a put, so the WRITE goes on reading its send buffer through that buffer's registration, for
as long as the peer takes to read it (a peer that stopped, or stopped making progress, reads it later). A
registration released, or memory freed, under it corrupts UCX's heap (a source SIGSTOPped past
``timeout_s`` and resumed crashed in its next group, once the version it had been sending was freed).
So a communicator that gives up a WRITE hands its handle to :meth:`NixlAgent.retire` with the buffers it
reads: the agent keeps them, and the registrations under them, until NIXL reports the WRITE finished
(done, failed, or its peer gone: polled at every later call into the agent), and only then releases the
handle and lets them go. The notification the finished WRITE carries releases the receiver's abandoned
buffer on the other side.

**Memory types.** Host buffers (numpy) are ``DRAM``; a buffer with ``__cuda_array_interface__`` (CuPy)
is ``VRAM`` on its device (not run on GPU).
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import fcntl
import ipaddress
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from jreshard.errors import BackendUnavailableError, PeerError, TransferTimeoutError
from jreshard.net.channel import Channel
from jreshard.types import ByteBuffer, NixlHandle, NixlModule

__all__ = ["NOTICE", "NixlAgent", "Region", "import_nixl", "interface_of", "label"]

_UNFINISHED: list[Any] = []  # WRITEs still running when their agent closed: kept (with their memory) for good

NOTICE = b"jreshard:"  # the prefix of every notification this transport sends; the receive id follows (then
# "/<bytes written>" for a message its sender sized)


def label(i: int, src: int, dst: int, tag: int) -> bytes:
    """What a message's MAC is bound to: its receive id (random, used once), ranks and tag."""
    return f"nixl {i} {src} {dst} {tag}".encode()


log = logging.getLogger("jreshard.nixl")


def import_nixl() -> NixlModule:
    """The ``nixl_cu12`` (or ``nixl_cu13``) module, or :class:`BackendUnavailableError` saying what to install.

    NIXL's Python logger prints every agent and backend it makes at INFO level on *stdout*; unless
    ``NIXL_LOG_LEVEL`` says otherwise, its level is set to WARNING, so a program's stdout stays its own.
    """
    errors = []
    for name in ("nixl_cu12", "nixl_cu13"):
        try:
            module = __import__(name)
        except ImportError as err:
            errors.append(f"{name}: {err}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs each agent and backend at INFO on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise BackendUnavailableError(
        "the NIXL transport needs NIXL: pip install --no-deps nixl-cu12 (or nixl-cu13; its torch requirement "
        f"is not needed) ({'; '.join(errors)})"
    )


_ENV_LOCK = threading.Lock()
_SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str | None:
    """The name of this host's network interface that holds address ``host`` (``"lo"`` for any loopback
    address); ``None`` for a wildcard (``"0.0.0.0"``, ``"::"``, ``""``) or an address no interface holds.

    Example:
      >>> interface_of("127.0.0.1"), interface_of("0.0.0.0")
      ('lo', None)
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:  # a host name: the address it resolves to
            ip = ipaddress.ip_address(socket.gethostbyname(host)) if host else ipaddress.ip_address("0.0.0.0")
        except (OSError, ValueError):
            return None
    if ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        if ip.version == 4:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
            if socket.inet_ntoa(got[20:24]) == str(ip):
                return name
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                        return fields[5]
        except OSError:
            return None
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """A buffer inside registered memory: what a transfer descriptor names."""

    mem: str  # "DRAM" or "VRAM"
    device: int
    address: int
    nbytes: int
    key: tuple[str, int, int, int]  # the registration it lies in
    serial: int = 0  # that registration's number in its agent (one registered again at the same place: a new one)


class _Retired:
    """A WRITE given up while it may still run: its handle, what it reads, and what is released after it."""

    __slots__ = ("descs", "dlists", "handle", "keep")

    def __init__(self, handle: NixlHandle, keep: tuple[Any, ...], dlists: tuple[Any, ...], descs: tuple[Any, ...]):
        self.handle, self.keep, self.dlists, self.descs = handle, keep, dlists, descs


class _Registration:
    """One registered range: its descriptors, partial metadata, and the roots that keep it (it dies with the last)."""

    __slots__ = ("descs", "key", "live", "partial", "roots", "serial")

    def __init__(self, key: tuple[str, int, int, int], descs: NixlHandle, partial: str, serial: int):
        self.key, self.descs, self.partial, self.serial = key, descs, partial, serial
        self.roots: list[weakref.ref] = []  # the roots alive that lie in it (one, but for views it contains)
        self.live = True

    def holds(self, root: Any) -> bool:
        return any(r() is root for r in self.roots)


def _describe(buffer: ByteBuffer) -> tuple[str, int, int, int, Any, int, int]:
    """``(mem, device, address, nbytes, root, root address, root nbytes)`` of a 1-D uint8 buffer."""
    cai = getattr(buffer, "__cuda_array_interface__", None)
    if cai is not None:  # CuPy: VRAM (not run on GPU)
        addr = int(cai["data"][0])
        device = int(buffer.device.id)
        mem = "VRAM"
    else:
        arr = buffer if isinstance(buffer, np.ndarray) else np.asarray(buffer)
        addr = int(arr.ctypes.data) if arr.nbytes else 0
        device = 0
        mem = "DRAM"
        buffer = arr
    nbytes = int(buffer.nbytes)
    root = buffer
    while True:
        base = getattr(root, "base", None)
        if isinstance(base, memoryview) and isinstance(base.obj, np.ndarray):
            base = base.obj  # np.frombuffer over an array (a pool's lease): the array below owns the memory
        if base is None or type(base) is not type(root):
            break
        root = base
    if root is not buffer and root.flags.c_contiguous:
        rcai = getattr(root, "__cuda_array_interface__", None)
        raddr = int(rcai["data"][0]) if rcai is not None else int(root.ctypes.data)
        rbytes = int(root.nbytes)
        if raddr <= addr and addr + nbytes <= raddr + rbytes:
            return mem, device, addr, nbytes, root, raddr, rbytes
    return mem, device, addr, nbytes, buffer, addr, nbytes


class NixlAgent:
    """One NIXL agent (UCX backend) for this process: registrations, peers, notifications (final).

    Args:
      name: the agent's name, unique among every agent it meets (default: host, pid and a random
        suffix).
      backends: the NIXL backends to create (default UCX).
      host: this host's address that this process's transfers use: UCX's network transports are restricted
        to the interface that holds it (``None`` or a wildcard: every interface, UCX's default).

    Attributes:
      registrations: memory registrations made so far (the tests count them: a refit loop whose
        buffers come back from the pools makes none after its first refits).

    Raises:
      BackendUnavailableError: NIXL is not installed, or has none of ``backends``.

    Use :meth:`shared` for the one agent of a process that every transfer in it reuses (making an
    agent costs 0.2-0.5 s).
    """

    _shared: NixlAgent | None = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str | None = None, *, backends: tuple[str, ...] = ("UCX",), host: str | None = None):
        nixl = import_nixl()
        self.name = name or f"jreshard-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        config = nixl.nixl_agent_config(
            enable_prog_thread=False,  # progress is made by the polling waits; a spinning thread costs a core
            enable_listen_thread=False,  # metadata goes over authenticated channels only
            backends=list(backends),
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # several threads of a process use it
        )
        self.interface = None if host is None else interface_of(host)
        if host is not None and self.interface is None and host not in ("", "0.0.0.0", "::"):
            log.warning("NixlAgent: no interface of this host holds %r: UCX may listen on every interface", host)
        with _ENV_LOCK:  # UCX reads its configuration from the environment when the agent makes its context
            before = os.environ.get("UCX_NET_DEVICES")
            if self.interface is not None and before is None:
                os.environ["UCX_NET_DEVICES"] = self.interface
            try:
                self._agent = nixl.nixl_agent(self.name, config)
            finally:
                if self.interface is not None and before is None:
                    del os.environ["UCX_NET_DEVICES"]
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise BackendUnavailableError(
                f"NixlAgent: NIXL has no {missing} backend here (plugins: {self._agent.get_plugin_list()})"
            )
        self._lock = threading.RLock()
        self._regs: dict[tuple[str, int, int, int], _Registration] = {}
        self._dead: list[_Registration] = []
        self._peers: weakref.WeakKeyDictionary[Channel, str] = weakref.WeakKeyDictionary()
        self._told: weakref.WeakKeyDictionary[Channel, set[tuple[str, int, int, int]]] = weakref.WeakKeyDictionary()
        self._notices: dict[int, str] = {}  # receive id -> the agent whose notification arrived
        self._sizes: dict[int, int] = {}  # receive id -> the bytes its notification said were written (sized)
        self._abandoned: dict[int, Any] = {}  # receive id -> its buffer, kept alive for a late WRITE
        self._expected: dict[int, str] = {}  # receive id -> the only agent whose notification counts
        self.ignored = 0  # notifications ignored: from an unexpected agent, or for no awaited id
        self._retired: list[_Retired] = []  # WRITEs given up and maybe still running (retire)
        self._pins: dict[int, int] = {}  # id of registration descs -> how many retired WRITEs read through them
        self._deferred: dict[int, Any] = {}  # id -> registration descs released once no retired WRITE reads them
        self.registrations = 0
        self.serials = 0  # registrations made (each one's serial)
        self._starts: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (mem, device) -> sorted (address, size)
        # counts registrations released and roots collected: a caller that kept addresses (prepared groups) sees
        # whether one it relies on may have gone
        self.epoch = 0
        self._pid = os.getpid()
        self.closed = False

    @classmethod
    def shared(cls, host: str | None = None) -> NixlAgent:
        """This process's agent, made at the first call (a forked child makes its own); ``host`` as for
        the constructor, heeded by the call that makes it."""
        with cls._shared_lock:
            agent = cls._shared
            if agent is None or agent._pid != os.getpid() or agent.closed:
                agent = cls._shared = cls(host=host)
            return agent

    @property
    def nixl(self) -> NixlModule:
        """The ``nixl_agent`` (for the communicator)."""
        return self._agent

    @property
    def registered_bytes(self) -> int:
        """Bytes of memory registered now."""
        with self._lock:
            self._release_dead()
            return sum(k[3] for k in self._regs)

    # ---- registrations --------------------------------------------------------------------------
    def region(self, buffer: ByteBuffer) -> Region:
        """Where ``buffer`` (contiguous 1-D uint8) lies in registered memory, registering its root if needed.

        A registration does not nest in another: NIXL finds the registration of a range by the nearest one
        starting at or before it, so a smaller one inside a larger one hides the larger from every range that
        starts in the smaller and ends past it (``NIXL_ERR_NOT_FOUND``). A root that lies inside a registration
        already made (a view whose owner is not its ``base``, as jax's memory is) joins that one, which then
        lives until its last root dies (see the module docstring for the other way round)."""
        mem, device, addr, nbytes, root, raddr, rbytes = _describe(buffer)
        key = (mem, device, raddr, rbytes)
        with self._lock:
            self._reap()
            self._release_dead()
            reg = self._regs.get(key)
            if reg is not None and not reg.holds(root):  # an older root at the same place: replace it
                self._deregister(reg)
                reg = None
            if reg is None and rbytes:
                reg = self._container(key)
                if reg is None:
                    if self._overlaps(key):
                        log.warning(
                            "NixlAgent: %d bytes at %#x hold or overlap memory registered before them: a WRITE "
                            "of a range that starts inside the older registration and ends past it may not find "
                            "its registration (NIXL_ERR_NOT_FOUND) until that one is released",
                            rbytes,
                            raddr,
                        )
                    descs = self._agent.register_memory([(raddr, rbytes, device, "")], mem)
                    self.registrations += 1
                    self.serials += 1
                    partial = self._agent.get_partial_agent_metadata(descs, inc_conn_info=False)
                    reg = _Registration(key, descs, base64.b64encode(partial).decode(), self.serials)
                    self._regs[key] = reg
                    bisect.insort(self._starts.setdefault((mem, device), []), (raddr, rbytes))
                if not reg.holds(root):  # (a view that joined it, seen again, is in it once)
                    reg.roots = [r for r in reg.roots if r() is not None]  # (views that come and go in one)
                    reg.roots.append(weakref.ref(root))
                    weakref.finalize(root, self._root_died, reg)
        if reg is None:
            return Region(mem, device, addr, nbytes, key)
        return Region(mem, device, addr, nbytes, reg.key, reg.serial)

    def _container(self, key: tuple[str, int, int, int]) -> _Registration | None:
        """The live registration whose range holds ``key``'s, if one does (the nearest starting at or before it)."""
        mem, device, addr, nbytes = key
        starts = self._starts.get((mem, device))
        if not starts:
            return None
        i = bisect.bisect_right(starts, (addr, float("inf"))) - 1
        while i >= 0:
            start, size = starts[i]
            if start + size >= addr + nbytes:
                reg = self._regs.get((mem, device, start, size))
                if reg is not None and any(r() is not None for r in reg.roots):
                    return reg
            if start < addr:
                return None
            i -= 1  # one at the same start, shorter: the one before may hold it
        return None

    def _overlaps(self, key: tuple[str, int, int, int]) -> bool:
        """Whether a registration shares a byte with ``key``'s range (none holds it: :meth:`_container`)."""
        mem, device, addr, nbytes = key
        starts = self._starts.get((mem, device), [])
        i = bisect.bisect_left(starts, (addr, 0))
        after = i < len(starts) and starts[i][0] < addr + nbytes
        before = i > 0 and starts[i - 1][0] + starts[i - 1][1] > addr
        return after or before

    def _root_died(self, reg: _Registration) -> None:
        """A root in ``reg`` was collected (from the collector: NIXL is not called here)."""
        self.epoch += 1
        if not any(r() is not None for r in reg.roots):
            self._dead.append(reg)

    def _deregister(self, reg: _Registration) -> None:
        if not reg.live:
            return
        reg.live = False
        self.epoch += 1
        if self._regs.get(reg.key) is reg:
            del self._regs[reg.key]
            starts = self._starts[reg.key[:2]]
            del starts[bisect.bisect_left(starts, reg.key[2:])]
        for told in self._told.values():
            told.discard(reg.key)
        self.deregister(reg.descs)

    def descs_of(self, key: tuple[str, int, int, int]) -> NixlHandle:
        """The registration descriptors of registration ``key`` (a :class:`Region`'s), ``None`` if released."""
        reg = self._regs.get(key)
        return None if reg is None else reg.descs

    def deregister(self, descs: NixlHandle) -> None:
        """Release the registration ``descs`` now, or, while a retired WRITE still reads through it, once none
        does."""
        with self._lock:
            if self._pins.get(id(descs)):
                self._deferred[id(descs)] = descs
                return
            self._agent.deregister_memory(descs)

    # ---- WRITEs given up ------------------------------------------------------------------------
    def retire(
        self,
        handle: NixlHandle,
        *,
        keep: tuple[Any, ...] = (),
        dlists: tuple[Any, ...] = (),
        descs: tuple[Any, ...] = (),
    ) -> None:
        """Give up the WRITE of ``handle`` (see the module docstring): it is released once NIXL no longer runs
        it, then ``dlists`` (its prepared descriptor lists) are, and until then ``keep`` (the buffers it reads)
        stays alive and the registrations ``descs`` stay registered (:meth:`deregister` waits for it).

        Never raises: a NIXL error here means the WRITE is over (its peer is gone)."""
        with self._lock:
            r = _Retired(handle, tuple(keep), tuple(dlists), tuple(d for d in descs if d is not None))
            for d in r.descs:
                self._pins[id(d)] = self._pins.get(id(d), 0) + 1
            self._retired.append(r)
            self._reap()

    @property
    def unfinished(self) -> int:
        """WRITEs given up that NIXL still runs (:meth:`retire`), polled now."""
        with self._lock:
            self._reap()
            return len(self._retired)

    def _reap(self) -> None:
        """Release every retired WRITE that NIXL no longer runs, and what waited on it."""
        if not self._retired:
            return
        still = []
        for r in self._retired:
            try:
                running = self._agent.check_xfer_state(r.handle) == "PROC"
            except Exception:  # nixl's own errors (its peer is gone): UCX failed the WRITE, nothing runs
                running = False
            if not running:
                try:
                    r.handle.release()
                except Exception:  # NIXL could not release it: still active, try again at the next call
                    running = True
            if running:
                still.append(r)
                continue
            for dl in r.dlists:
                try:
                    dl.release()
                except Exception:  # a descriptor list NIXL refuses to release leaks, nothing worse
                    pass
            for d in r.descs:
                n = self._pins[id(d)] - 1
                if n:
                    self._pins[id(d)] = n
                    continue
                del self._pins[id(d)]
                gone = self._deferred.pop(id(d), None)
                if gone is not None:
                    self._agent.deregister_memory(gone)
        self._retired = still

    def _release_dead(self) -> None:
        while self._dead:
            self._deregister(self._dead.pop())

    def unannounced(self, channel: Channel, keys: set[tuple[str, int, int, int]]) -> list[str]:
        """The partial metadata (base64) of the registrations among ``keys`` that the peer on ``channel``
        has not been sent yet; they count as sent from now on."""
        with self._lock:
            told = self._told.setdefault(channel, set())
            out = [self._regs[k].partial for k in sorted(keys - told) if k in self._regs]
            told |= keys
            return out

    def load(self, channel: Channel, metadata: list[str]) -> None:
        """Load partial metadata a peer sent with its descriptors."""
        if self._peers.get(channel) == self.name:
            return  # a loopback peer: this agent knows its own registrations
        with self._lock:
            for md in metadata:
                try:
                    self._agent.add_remote_agent(base64.b64decode(md, validate=True))
                except Exception as err:  # nixl raises its own exception types
                    raise PeerError(f"{channel.peer} sent NIXL metadata that does not load ({err})") from err

    # ---- peers ----------------------------------------------------------------------------------
    def introduce(self, channels: list[Channel], *, timeout_s: float) -> None:
        """Exchange agent metadata with the peer on each channel not yet introduced (both sides call it).

        Raises:
          PeerError: a peer closed, or sent metadata that does not load.
          TransferTimeoutError: a peer did not introduce itself within ``timeout_s``.
        """
        new = [ch for ch in dict.fromkeys(channels) if ch not in self._peers]
        if not new:
            return
        md = base64.b64encode(self._agent.get_agent_metadata()).decode()
        for ch in new:
            ch.send_control({"op": "nixl.hello", "agent": self.name, "md": md}, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        waiting = list(new)
        while waiting:
            for ch in list(waiting):
                ch.pump()
                got = ch.take({"nixl.hello"})
                if got:
                    self._meet(ch, got[-1])
                    waiting.remove(ch)
                elif ch.eof:
                    raise ch.closed_error()
            if waiting and time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"NixlAgent: {', '.join(ch.peer for ch in waiting)} did not introduce its NIXL agent within "
                    f"timeout_s={timeout_s}"
                )
            if waiting:
                select.select(waiting, [], [], 0.01)

    def _meet(self, ch: Channel, hello: dict) -> None:
        name, md = hello.get("agent"), hello.get("md")
        if not isinstance(name, str) or not isinstance(md, str):
            raise PeerError(f"{ch.peer} sent a malformed NIXL introduction")
        with self._lock:
            if name != self.name:
                try:
                    loaded = self._agent.add_remote_agent(base64.b64decode(md, validate=True))
                except Exception as err:  # nixl raises its own exception types
                    raise PeerError(f"{ch.peer}: its NIXL metadata does not load ({err})") from err
                if loaded.decode() != name:
                    raise PeerError(f"{ch.peer} introduced agent {name!r} but its metadata names {loaded!r}")
            self._peers[ch] = name
            self._told[ch] = set()

    def peer(self, channel: Channel) -> str:
        """The agent name of the peer on ``channel`` (introduced)."""
        return self._peers[channel]

    # ---- notifications --------------------------------------------------------------------------
    def new_id(self, sender: str) -> int:
        """A fresh receive id (63 random bits) that only agent ``sender``'s notification completes."""
        with self._lock:
            while True:
                i = secrets.randbits(63)
                if i and i not in self._expected:
                    self._expected[i] = sender
                    return i

    def arrived(self, ids: set[int], sizes: dict[int, int] | None = None) -> dict[int, str]:
        """Which of ``ids`` have been notified by their expected agent (``{id: agent}``), removed from the
        store. Any other notification is ignored (and counted in :attr:`ignored`).

        A notification ``<id>/<bytes>`` also says how many bytes its WRITE wrote (a message sized by its
        sender, :meth:`NixlComm.exchange_sized`): for each id returned, that count goes into ``sizes``."""
        with self._lock:
            self._reap()
            for agent, msgs in self._agent.get_new_notifs().items():
                for m in msgs:
                    digits, slash, count = (m[len(NOTICE) :] if m.startswith(NOTICE) else b"").partition(b"/")
                    i = int(digits) if digits.isdigit() and len(digits) <= 19 else None
                    nbytes = int(count) if count.isdigit() and len(count) <= 19 else None
                    if i is None or self._expected.get(i) != agent or (slash and nbytes is None):
                        self.ignored += 1
                        log.warning("ignored a NIXL notification from agent %r: %r", agent, m[:64])
                        continue
                    if i in self._abandoned:
                        del self._abandoned[i]  # the late WRITE landed: its buffer may go
                        del self._expected[i]
                    else:
                        self._notices[i] = agent
                        if nbytes is not None:
                            self._sizes[i] = nbytes
            out = {i: self._notices.pop(i) for i in ids if i in self._notices}
            for i in out:
                del self._expected[i]
                nbytes = self._sizes.pop(i, None)
                if nbytes is not None and sizes is not None:
                    sizes[i] = nbytes
            return out

    def abandon(self, receives: Mapping[int, Any]) -> None:
        """Receives given up on (a failed exchange), ``{id: buffer}``: their late notifications are
        dropped, and each buffer is kept alive until its notification comes (a peer may still be
        writing into it; its memory must not be reused meanwhile) or the agent closes."""
        with self._lock:
            for i, buffer in receives.items():
                self._sizes.pop(i, None)
                if self._notices.pop(i, None) is None:
                    self._abandoned[i] = buffer
                else:
                    self._expected.pop(i, None)

    def close(self) -> None:
        """Release every registration and forget every peer (a retired WRITE that still runs keeps its memory
        and registration for the life of the process)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._reap()
            self._release_dead()
            for reg in list(self._regs.values()):
                self._deregister(reg)
            if self._retired:  # still running: their handles, buffers and registrations are kept for good
                _UNFINISHED.append((self._agent, self._retired, self._deferred))
                log.warning("NixlAgent.close: %d WRITEs given up still run; their memory is kept", len(self._retired))
                self._retired, self._pins, self._deferred = [], {}, {}
            for name in set(self._peers.values()):
                if name != self.name:
                    try:
                        self._agent.remove_remote_agent(name)
                    except Exception:
                        pass
            self._peers.clear()
            self._abandoned.clear()
            self._expected.clear()
            self._sizes.clear()
