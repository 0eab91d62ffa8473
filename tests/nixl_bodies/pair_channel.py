"""The authenticated channel between the two processes of a NIXL test pair: process 0 listens and writes its
address to a file, process 1 reads it and connects (the bodies in this folder run as scripts, side by side)."""

from __future__ import annotations

import os

from jreshard.net.channel import accept_one, connect, format_address, listen, parse_address


def channel(me: int, address_file: str, key: bytes):
    if me == 0:
        server = listen("127.0.0.1", 0)
        with open(address_file + ".tmp", "w") as f:
            f.write(format_address(*server.getsockname()[:2]))
        os.replace(address_file + ".tmp", address_file)
        return accept_one(server, "process 1", key=key, timeout_s=30)
    return connect(parse_address(address_file, timeout_s=30), "process 0", key=key, timeout_s=30)
