"""Faults planted in an elastic trainer, for the in-process elastic tests."""

from __future__ import annotations

from jreshard import PeerError
from jreshard.elastic import membership as membership_module
from jreshard.nixl import NixlComm
from jreshard.nixl.prepared import NixlPrepared


def break_the_trainers_send(monkeypatch, after: int) -> None:
    """From now on, each version the trainer sends stops at its ``after``-th NIXL exchange (a group posted
    afresh, or a prepared group started): the replica's channel is closed and the exchange raises, as a trainer
    that dies mid-version."""
    real = membership_module.Membership._send

    def half(self, m, leaves, use):
        calls = {"n": 0}
        exchange, sized, start = NixlComm.exchange, NixlComm.exchange_sized, NixlPrepared.start

        def stop() -> None:
            m.channels[0].close()
            raise PeerError("stopped on purpose")

        def some(comm, sends, recvs, *, timeout_s):
            calls["n"] += 1
            if calls["n"] == after:
                stop()
            return exchange(comm, sends, recvs, timeout_s=timeout_s)

        def some_sized(comm, sends, recvs, *, timeout_s):  # a delta refit's groups
            calls["n"] += 1
            if calls["n"] == after:
                stop()
            return sized(comm, sends, recvs, timeout_s=timeout_s)

        def some_started(prepared, group, timeout_s):
            calls["n"] += 1
            if calls["n"] == after:
                stop()
            return start(prepared, group, timeout_s)

        monkeypatch.setattr(NixlComm, "exchange", some)
        monkeypatch.setattr(NixlComm, "exchange_sized", some_sized)
        monkeypatch.setattr(NixlPrepared, "start", some_started)
        try:
            real(self, m, leaves, use)
        finally:
            monkeypatch.setattr(NixlComm, "exchange", exchange)
            monkeypatch.setattr(NixlComm, "exchange_sized", sized)
            monkeypatch.setattr(NixlPrepared, "start", start)

    monkeypatch.setattr(membership_module.Membership, "_send", half)
