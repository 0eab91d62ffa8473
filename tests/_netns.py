"""Network namespaces for the fault suite: programs on separate "hosts" of one machine.

:class:`Network` makes a hub namespace holding a Linux bridge and one namespace per host, each joined
to the bridge by a veth pair, with an address in 10.213.X.0/24 (X from the test process's id, so
workers do not clash), loopback up, and the host's link held to a rate with ``tc ... tbf`` (the
kernel here has no netem). Everything it made is deleted in :meth:`Network.close`, on failure too.

Packet loss (``loss=``): the kernel here has neither netem nor a packet filter, so each host gets a TUN
device instead of a veth, and a relay thread of the test process moves every IPv4 packet from the
sender's TUN to the receiver's, dropping each with probability ``loss`` (seeded): TCP (the control
plane, UCX's and MPI's bytes) sees real loss and retransmits.
:class:`Program` runs a command inside a namespace and collects the JSON lines it prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import random
import select
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Sequence


def available() -> str:
    """Why the suite cannot run here (empty: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"jrsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


_TUNSETIFF, _IFF_TUN, _IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


class _Relay:
    """Moves IPv4 packets between TUN devices by destination address, dropping each with probability ``loss``."""

    def __init__(self, loss: float, seed: int):
        self.loss, self.rng = loss, random.Random(seed)
        self.fds: dict[bytes, int] = {}  # a host's address (4 bytes) -> its TUN's descriptor
        self.passed = self.dropped = 0
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="netns-relay", daemon=True)

    def add(self, name: str, address: str) -> None:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
        self.fds[bytes(int(x) for x in address.split("."))] = fd

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        fds = list(self.fds.values())
        while True:
            ready, _, _ = select.select([*fds, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            for fd in ready:
                try:
                    packet = os.read(fd, 65536)
                except OSError:
                    continue
                out = self.fds.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
                if out is None:
                    continue
                if self.rng.random() < self.loss:
                    self.dropped += 1
                    continue
                try:
                    os.write(out, packet)
                    self.passed += 1
                except OSError:  # the receiver's link is down: lost
                    self.dropped += 1

    def close(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(5)
        for fd in [*self.fds.values(), self._stop_r, self._stop_w]:
            os.close(fd)
        self.fds.clear()


class Network:
    """A bridge and ``hosts`` namespaces on it (see the module docstring); with ``loss``, a lossy relay."""

    def __init__(self, hosts: Sequence[str], *, rate: str = "60mbit", loss: float = 0.0, seed: int = 0):
        tag = os.getpid() % 100000
        self.subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.hub = f"jrs{tag}h"
        self.ns: dict[str, str] = {}
        self.dev: dict[str, str] = {}
        self.addr: dict[str, str] = {}
        self._made: list[str] = []
        self.relay: _Relay | None = _Relay(loss, seed) if loss > 0 else None
        try:
            if self.relay is not None:
                self._tuns(hosts, tag, rate)
                return
            _ip("netns", "add", self.hub)
            self._made.append(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, h in enumerate(hosts):
                ns, dev, peer = f"jrs{tag}{h}", f"jv{tag}{i}", f"jp{tag}{i}"
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", dev, "type", "veth", "peer", "name", peer)
                _ip("link", "set", dev, "netns", ns)
                _ip("link", "set", peer, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", peer, "master", "br0")
                _ip("-n", self.hub, "link", "set", peer, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
                subprocess.run([*tc, "burst", "64kb", "latency", "100ms"], check=True, capture_output=True)
                self.ns[h], self.dev[h], self.addr[h] = ns, dev, f"{self.subnet}.{i + 1}"
        except BaseException:
            self.close()
            raise

    def _tuns(self, hosts: Sequence[str], tag: int, rate: str) -> None:
        """Each host a namespace with a TUN device on the relay (no bridge)."""
        assert self.relay is not None
        for i, h in enumerate(hosts):
            ns, dev, addr = f"jrs{tag}{h}", f"jt{tag}{i}", f"{self.subnet}.{i + 1}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            self.relay.add(dev, addr)
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
            subprocess.run([*tc, "burst", "64kb", "latency", "100ms"], check=True, capture_output=True)
            self.ns[h], self.dev[h], self.addr[h] = ns, dev, addr
        self.relay.start()

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s link down or bring it up."""
        _ip("-n", self.ns[host], "link", "set", self.dev[host], "up" if up else "down")

    def close(self) -> None:
        """Delete every namespace made (their links go with them)."""
        for ns in reversed(self._made):  # a program left running in one of them is ours: end it by its id
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        if self.relay is not None:
            self.relay.close()
            self.relay = None


class Program:
    """``cmd`` in namespace ``ns`` (its own session), its JSON stdout lines collected as events."""

    def __init__(self, name: str, ns: str, cmd: Sequence[str], env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.events: list[dict] = []
        self.proc_end = float("inf")  # when it was first seen ended (finish)
        self.lines: list[str] = []
        self._new: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("{"):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                e["t"] = time.monotonic()
                self.events.append(e)
                self._new.put(e)

    def wait_event(self, event: str, timeout_s: float, **match: object) -> dict:
        """The first event named ``event`` (with the given fields) so far or within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for e in self.events[seen:]:
                seen += 1
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {event} {match} within {timeout_s} s:\n" + self.tail())
            try:
                self._new.get(timeout=0.05)
            except queue.Empty:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    msg = f"{self.name} exited ({self.proc.returncode}) before {event}:\n{self.tail()}"
                    raise AssertionError(msg) from None

    @property
    def pid(self) -> int:
        """The pid the program printed in its ``ready`` event (the Python process itself)."""
        return int(self.wait_event("ready", 120)["pid"])

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def finish(self, timeout_s: float) -> int:
        """Its exit status; killed (its whole session) after ``timeout_s``, which fails the caller."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} hung: still running {timeout_s} s on:\n{self.tail()}") from None
        self.proc_end = min(self.proc_end, time.monotonic())
        self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(5)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def of(self, event: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == event]
