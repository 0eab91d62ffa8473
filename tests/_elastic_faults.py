"""Faults planted in an elastic trainer, for the in-process elastic tests."""

from __future__ import annotations

from jreshard import PeerError
from jreshard.elastic import membership as membership_module
from jreshard.nixl import NixlComm


def break_the_trainers_send(monkeypatch, after: int) -> None:
    """From now on, each version the trainer sends stops at its ``after``-th NIXL exchange: the replica's
    channel is closed and the exchange raises, as a trainer that dies mid-version."""
    real = membership_module.Membership._send

    def half(self, m, leaves):
        calls = {"n": 0}
        exchange = NixlComm.exchange

        def some(comm, sends, recvs, *, timeout_s):
            calls["n"] += 1
            if calls["n"] == after:
                m.channels[0].close()
                raise PeerError("stopped on purpose")
            return exchange(comm, sends, recvs, timeout_s=timeout_s)

        monkeypatch.setattr(NixlComm, "exchange", some)
        try:
            real(self, m, leaves)
        finally:
            monkeypatch.setattr(NixlComm, "exchange", exchange)

    monkeypatch.setattr(membership_module.Membership, "_send", half)
