"""The shared secret and the challenge-response that proves, in both directions, that a peer holds it.

Every connection between two jreshard programs (trainer and replica, replica and replica, the two
sides of a ``RefitGroup`` over NIXL) runs this exchange before any declaration, descriptor or byte
of weights; :mod:`jreshard.channel` drives it over the socket. With ``K`` the key and ``Ns``, ``Nc``
32 random bytes drawn by the server and the client (``secrets.token_bytes``):

1. server -> client: ``MAGIC || Ns`` (the challenge, :data:`CHALLENGE_BYTES` bytes);
2. client -> server: ``MAGIC || Nc || HMAC-SHA256(K, "jreshard client" || Ns || Nc)``;
3. server -> client: ``HMAC-SHA256(K, "jreshard server" || Nc || Ns)``.

The server checks (2) and the client checks (3) with ``hmac.compare_digest``. A client without the
key cannot answer a fresh ``Ns``; a server without it cannot answer ``Nc``, so a process posing as a
trainer or as a peer replica cannot serve weights. Every message has a fixed size, so nothing read
before the peer is authenticated sizes an allocation. The key is never sent; replaying a recorded
exchange fails because the other side's nonce is new. The exchange authenticates the peer; it does
not encrypt what follows (run on a network you trust for confidentiality, or under a VPN/TLS tunnel).

The key: ``Options.secret``, else the environment variable ``JRESHARD_SECRET`` (its UTF-8 bytes),
else the contents of the file named by ``JRESHARD_SECRET_FILE`` (surrounding whitespace stripped).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

__all__ = [
    "ANSWER_BYTES",
    "CHALLENGE_BYTES",
    "MAGIC",
    "MIN_SECRET_BYTES",
    "PROOF_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "answer",
    "challenge",
    "check_answer",
    "check_proof",
    "proof",
    "resolve_secret",
]

MAGIC = b"JRSHAUTH\x01"  # names the protocol and its version; anything else is refused at once
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
ANSWER_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES
PROOF_BYTES = MAC_BYTES
MIN_SECRET_BYTES = 16
SECRET_ENV = "JRESHARD_SECRET"
SECRET_FILE_ENV = "JRESHARD_SECRET_FILE"


def resolve_secret(secret: bytes | None, *, environ: Mapping[str, str] | None = None, who: str = "jreshard") -> bytes:
    """The key: ``secret``, else ``$JRESHARD_SECRET``, else the file ``$JRESHARD_SECRET_FILE`` names.

    Args:
      secret: ``Options.secret``.
      environ: where to read the variables (default ``os.environ``).
      who: names the caller in the error.

    Raises:
      ValueError: no key is set, the file cannot be read, or the key is shorter than 16 bytes.

    Example:
      >>> resolve_secret(None, environ={"JRESHARD_SECRET": "0123456789abcdef"})
      b'0123456789abcdef'
    """
    env = os.environ if environ is None else environ
    where = "Options(secret=...)"
    key = secret
    if key is None and env.get(SECRET_ENV):
        key, where = env[SECRET_ENV].encode(), f"${SECRET_ENV}"
    if key is None and env.get(SECRET_FILE_ENV):
        path = env[SECRET_FILE_ENV]
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as err:
            raise ValueError(f"{who}: ${SECRET_FILE_ENV}={path!r} cannot be read ({err})") from None
        where = f"the file ${SECRET_FILE_ENV}={path!r}"
    if key is None:
        raise ValueError(
            f"{who}: connections between programs need a shared secret; the fix is to give every program the "
            f"same key as Options(secret=b'...'), the environment variable {SECRET_ENV}, or a file named by "
            f"{SECRET_FILE_ENV} (at least {MIN_SECRET_BYTES} bytes, e.g. python -c 'import secrets; "
            "print(secrets.token_hex(32))')"
        )
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{who}: the secret from {where} has {len(key)} bytes; it needs at least {MIN_SECRET_BYTES}")
    return key


def _mac(key: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


def challenge() -> tuple[bytes, bytes]:
    """``(message, nonce)``: the server's first message and the nonce it must remember."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return MAGIC + nonce, nonce


def answer(key: bytes, message: bytes) -> tuple[bytes, bytes] | None:
    """``(answer, client nonce)`` to the server's challenge ``message``; ``None`` when it is not one."""
    if len(message) != CHALLENGE_BYTES or not hmac.compare_digest(message[: len(MAGIC)], MAGIC):
        return None
    server_nonce = message[len(MAGIC) :]
    nonce = secrets.token_bytes(NONCE_BYTES)
    return MAGIC + nonce + _mac(key, b"jreshard client", server_nonce, nonce), nonce


def check_answer(key: bytes, server_nonce: bytes, message: bytes) -> bytes | None:
    """The client's nonce if ``message`` proves the client holds ``key``, else ``None``.

    Example:
      >>> key = b"k" * 16
      >>> hello, ns = challenge()
      >>> reply, nc = answer(key, hello)
      >>> check_answer(key, ns, reply) == nc, check_answer(b"x" * 16, ns, reply)
      (True, None)
      >>> check_proof(key, nc, ns, proof(key, ns, nc)), check_proof(key, nc, ns, bytes(32))
      (True, False)
    """
    if len(message) != ANSWER_BYTES or not hmac.compare_digest(message[: len(MAGIC)], MAGIC):
        return None
    nonce = message[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    mac = message[len(MAGIC) + NONCE_BYTES :]
    if not hmac.compare_digest(mac, _mac(key, b"jreshard client", server_nonce, nonce)):
        return None
    return nonce


def proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The server's proof that it holds ``key``, bound to both nonces."""
    return _mac(key, b"jreshard server", client_nonce, server_nonce)


def check_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, message: bytes) -> bool:
    """Whether ``message`` is the server's proof for these nonces."""
    return len(message) == PROOF_BYTES and hmac.compare_digest(message, proof(key, server_nonce, client_nonce))
