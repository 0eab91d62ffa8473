"""The shared secret and the challenge-response that proves, in both directions, that a peer holds it.

Every connection between two jreshard programs (trainer and replica, replica and replica, the two
sides of a ``RefitGroup`` over NIXL) runs this exchange before any declaration, descriptor or byte
of weights; :mod:`jreshard.net.channel` drives it over the socket. With ``K`` the key and ``Ns``, ``Nc``
32 random bytes drawn by the server and the client (``secrets.token_bytes``):

1. server -> client: ``MAGIC || Ns`` (the challenge, :data:`CHALLENGE_BYTES` bytes);
2. client -> server: ``MAGIC || Nc || HMAC-SHA256(K, "jreshard client" || Ns || Nc)``;
3. server -> client: ``HMAC-SHA256(K, "jreshard server" || Nc || Ns)``.

The server checks (2) and the client checks (3) with ``hmac.compare_digest``. A client without the
key cannot answer a fresh ``Ns``; a server without it cannot answer ``Nc``, so a process posing as a
trainer or as a peer replica cannot serve weights. Every message has a fixed size, so nothing read
before the peer is authenticated sizes an allocation. The key is never sent; replaying a recorded
exchange fails because the other side's nonce is new.

**The session.** The exchange also keys what follows: both sides derive, with HKDF-SHA256
(``cryptography``) over the key, salted with ``Ns || Nc``, one ChaCha20-Poly1305 key per direction,
a key for the tags of the transfer's bytes, and one AES-256-GCM key per direction for the weights
when they are encrypted (:class:`Session`). Every control frame after the
handshake is sealed under its direction's key with its sequence number as the nonce, so a frame that
was read, altered, replayed, reordered or dropped on the way is refused and ends the connection
(:mod:`jreshard.net.channel`). A relay that passes the handshake through untouched learns neither key:
it cannot read what follows, nor speak in it.

The key: ``Options.secret``, else the environment variable ``JRESHARD_SECRET`` (its UTF-8 bytes),
else the contents of the file named by ``JRESHARD_SECRET_FILE`` (surrounding whitespace stripped).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from jreshard.errors import BackendUnavailableError

__all__ = [
    "ANSWER_BYTES",
    "BoxMacs",
    "CHALLENGE_BYTES",
    "MAGIC",
    "MIN_SECRET_BYTES",
    "PROOF_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "TAG_BYTES",
    "Session",
    "answer",
    "challenge",
    "check_answer",
    "check_proof",
    "proof",
    "resolve_secret",
]

MAGIC = b"JRSHAUTH\x02"  # names the protocol and its version; anything else is refused at once (2: box MACs per refit)
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
ANSWER_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES
PROOF_BYTES = MAC_BYTES
MIN_SECRET_BYTES = 16
SECRET_ENV = "JRESHARD_SECRET"
SECRET_FILE_ENV = "JRESHARD_SECRET_FILE"
TAG_BYTES = 16  # a ChaCha20-Poly1305 frame's tag, and a Poly1305 MAC


class _Crypto:
    """The primitives of ``cryptography`` a session uses, imported on first use (connections between programs
    need the package; one program's transfers do not)."""

    def __init__(self) -> None:
        try:
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF
            from cryptography.hazmat.primitives.poly1305 import Poly1305
        except ImportError as err:
            raise BackendUnavailableError(
                "connections between programs (RefitGroup.connect, jreshard.elastic, NIXL groups) are encrypted "
                f"with the cryptography package: pip install 'jreshard[net]' ({err})"
            ) from err
        self.hashes: ModuleType | Any = hashes
        self.AESGCM, self.ChaCha20Poly1305, self.HKDF, self.Poly1305 = AESGCM, ChaCha20Poly1305, HKDF, Poly1305


_CRYPTO: _Crypto | None = None


def _crypto() -> _Crypto:
    global _CRYPTO
    if _CRYPTO is None:
        _CRYPTO = _Crypto()
    return _CRYPTO


_SESSION_INFO = b"jreshard session v1: client->server, server->client, transfer MACs"


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


_GMAC_SPAN = 1 << 30  # the most one AES-GCM call authenticates (the library takes under 2**31 bytes)
_BOX_IV = b"jrshbox:"  # every box MAC's GCM nonce starts so; then the message's label, then its span's index
_BOX_LABEL_MAX = 128 - len(_BOX_IV) - 4  # the library's nonces are at most 128 bytes
_SPAN0 = struct.pack("!I", 0)


class BoxMacs:
    """AES-256-GMAC tags of one refit's messages on one connection, under one key (final).

    Each message is tagged under its own GCM nonce, ``"jrshbox:" || label || span`` (``label``: the message's
    identity in the refit, its ranks, tag and occurrence; ``span``: a 4-byte index, 0 but for buffers past
    1 GiB, tagged in spans of 1 GiB, the library's limit, their tags concatenated). So no (key, nonce) pair
    tags two messages as long as each label names one message of the refit, which the callers guarantee
    (:class:`jreshard.engine.digest.Digests`), and the key changes with every refit. GCM takes nonces of any
    length; one of other than 12 bytes is hashed into the counter block with its length, so nonces of
    different labels never meet. Made by :meth:`Session.box_macs`: the key schedule runs once per refit and
    connection, not once per message (a 64-byte message: 0.96 us, where a one-time key each took 2.12).
    """

    __slots__ = ("_gmac",)

    def __init__(self, key: bytes):
        self._gmac = _crypto().AESGCM(key)

    def __call__(self, label: bytes, data: object) -> bytes:
        """The tag of ``data`` (a contiguous buffer of bytes) under ``label`` (at most 116 bytes)."""
        if len(label) > _BOX_LABEL_MAX:
            raise ValueError(f"BoxMacs: a label is at most {_BOX_LABEL_MAX} bytes, not {len(label)}")
        view = memoryview(data)  # type: ignore[arg-type]
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n, gmac = len(view), self._gmac
        if n <= _GMAC_SPAN:  # one span: the common case, without the join
            return gmac.encrypt(_BOX_IV + label + _SPAN0, b"", view)
        return b"".join(
            gmac.encrypt(_BOX_IV + label + struct.pack("!I", i), b"", view[lo : lo + _GMAC_SPAN])
            for i, lo in enumerate(range(0, n, _GMAC_SPAN))
        )


class Session:
    """The keys of one authenticated connection, derived from the handshake (final).

    ``HKDF-SHA256(ikm=key, salt=Ns || Nc, info=...)`` gives 160 bytes: the client-to-server and the
    server-to-client ChaCha20-Poly1305 keys of the control frames, the key of :meth:`mac`, and an
    AES-256-GCM key per direction for the data plane (:meth:`seal_into`). Both sides derive the same
    ones; nobody without the key can. Sequence numbers count the frames (and, apart, the sealed
    messages) of each direction from 0 and are the AEAD's nonces, so each (key, nonce) pair is used once.

    Args:
      key: the shared secret.
      server_nonce, client_nonce: the handshake's two nonces.
      client: which end this is (its sending direction).

    Example:
      >>> ns, nc = bytes(32), bytes(range(32))
      >>> a, b = Session(b"k" * 16, ns, nc, client=True), Session(b"k" * 16, ns, nc, client=False)
      >>> b.open(b"header", a.seal(b"header", b"hello"))
      b'hello'
      >>> b.open(b"header", a.seal(b"header", b"again")), b.received
      (b'again', 2)
      >>> a.seal(b"header", b"x") and b.open(b"header", a.seal(b"header", b"y")) is None  # one dropped
      True
    """

    __slots__ = ("_data_recv", "_data_send", "_mac_key", "_recv", "_send", "data_sent", "received", "sent")

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes, *, client: bool):
        salt = server_nonce + client_nonce
        c = _crypto()
        okm = c.HKDF(algorithm=c.hashes.SHA256(), length=160, salt=salt, info=_SESSION_INFO).derive(key)
        c2s, s2c, self._mac_key, data_c2s, data_s2c = (okm[i : i + 32] for i in range(0, 160, 32))
        self._send = c.ChaCha20Poly1305(c2s if client else s2c)
        self._recv = c.ChaCha20Poly1305(s2c if client else c2s)
        self._data_send = c.AESGCM(data_c2s if client else data_s2c)
        self._data_recv = c.AESGCM(data_s2c if client else data_c2s)
        self.sent = 0
        self.received = 0
        self.data_sent = 0

    @staticmethod
    def _nonce(seq: int) -> bytes:
        return struct.pack("!IQ", 0, seq)

    def seal(self, header: bytes, body: bytes) -> bytes:
        """``body`` encrypted and tagged under the next sending sequence number, ``header`` authenticated."""
        out = self._send.encrypt(self._nonce(self.sent), body, header)
        self.sent += 1
        return out

    def open(self, header: bytes, sealed: bytes) -> bytes | None:
        """The body of the next frame received, or ``None`` when it fails its tag: altered, replayed,
        reordered, dropped (the next one then fails), or sealed by someone without the keys."""
        try:
            body = self._recv.decrypt(self._nonce(self.received), sealed, header)
        except Exception:  # cryptography.exceptions.InvalidTag, or a frame shorter than a tag
            return None
        self.received += 1
        return body

    def seal_into(self, label: bytes, data: object, out: object) -> int:
        """Encrypt ``data`` (a contiguous buffer) into ``out`` (``TAG_BYTES`` longer) with AES-256-GCM under
        this side's data key, ``label`` authenticated with it; the message's sequence number (its nonce,
        sent to the receiver inside the sealed channel).

        Example:
          >>> import numpy as np
          >>> a = Session(b"k" * 16, bytes(32), bytes(32), client=True)
          >>> b = Session(b"k" * 16, bytes(32), bytes(32), client=False)
          >>> sealed, back = np.empty(21, np.uint8), np.empty(5, np.uint8)
          >>> seq = a.seal_into(b"id 7", b"hello", sealed)
          >>> b.open_into(seq, b"id 7", sealed, back), back.tobytes(), b.open_into(seq, b"id 8", sealed, back)
          (True, b'hello', False)
        """
        seq = self.data_sent
        self.data_sent += 1
        self._data_send.encrypt_into(struct.pack("!IQ", 1, seq), data, label, out)  # type: ignore[arg-type]
        return seq

    def open_into(self, seq: int, label: bytes, sealed: object, out: object) -> bool:
        """Decrypt the peer's message ``seq`` from ``sealed`` into ``out``; False (``out`` undefined) when
        it fails its tag: altered, sealed for another label, or by someone without the key."""
        if not 0 <= seq < 1 << 64:
            return False
        try:
            self._data_recv.decrypt_into(struct.pack("!IQ", 1, seq), sealed, label, out)  # type: ignore[arg-type]
        except Exception:  # cryptography.exceptions.InvalidTag, or sizes that do not match
            return False
        return True

    def box_macs(self, context: bytes) -> BoxMacs:
        """The AES-256-GMAC of one refit's messages on this connection: a :class:`BoxMacs` under the key
        ``BLAKE2b(key=the session's MAC key, context)`` (the box MACs' context holds a nonce drawn for each refit,
        :func:`jreshard.refit.boxes.keyed`), which tags each message under its own label.

        Example:
          >>> s = Session(b"k" * 16, bytes(32), bytes(32), client=True)
          >>> mac = s.box_macs(b"refit 1")
          >>> t = mac(b"message 7", b"weights")
          >>> len(t), t == mac(b"message 7", b"weights"), t == mac(b"message 7", b"weightz")
          (16, True, False)
          >>> t == mac(b"message 8", b"weights")
          False
          >>> t == s.box_macs(b"refit 2")(b"message 7", b"weights")
          False
        """
        return BoxMacs(hashlib.blake2b(context, key=self._mac_key, digest_size=32, person=b"jreshard gmac/2").digest())

    def mac(self, label: bytes, data: object) -> bytes:
        """A Poly1305 tag of ``data`` (any contiguous buffer) under a one-time key for ``label``.

        The one-time key is ``BLAKE2b(key=the session's MAC key, label)``: each label (a receive id,
        drawn at random, with its ranks and tag) must name one message of this session.

        Example:
          >>> s = Session(b"k" * 16, bytes(32), bytes(32), client=True)
          >>> t = s.mac(b"id 7", b"weights")
          >>> len(t), t == s.mac(b"id 7", b"weights"), t == s.mac(b"id 7", b"weightz"), t == s.mac(b"id 8", b"weights")
          (16, True, False, False)
        """
        one_time = hashlib.blake2b(label, key=self._mac_key, digest_size=32, person=b"jreshard mac").digest()
        return _crypto().Poly1305.generate_tag(one_time, data)  # type: ignore[arg-type]
