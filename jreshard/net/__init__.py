"""The control plane between programs, below every cross-program transport.

- :mod:`jreshard.net.auth`: the shared secret, the handshake's keys, the sealed frames and transfer tags;
- :mod:`jreshard.net.channel`: authenticated, bounded control connections (frames, listeners, rendezvous);
- :mod:`jreshard.net.ports`: a port held for a jax coordinator until it has bound it.
"""
