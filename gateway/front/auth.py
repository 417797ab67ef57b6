"""Who may call: client API keys (from settings and a file re-read when it changes) and the
admin token, each compared in constant time and never logged.

Keys are kept as SHA-256 digests and every one is compared (`hmac.compare_digest`, no early
exit), so the time a check takes says nothing about how much of a key was right.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable

from gateway.front.tenants import NO_LIMITS, KeyLimits
from gateway.support.errors import NotFound, Unauthorized

log = logging.getLogger(__name__)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(authorization: str | None) -> str:
    """The credential of an `Authorization: Bearer <credential>` header, or ""."""
    scheme, _, credential = (authorization or "").partition(" ")
    return credential.strip() if scheme.lower() == "bearer" else ""


def _matches(given: str, digests: list[bytes]) -> bool:
    wanted = _digest(given)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(digest, wanted)
    return found


def read_keys(path: str) -> list[tuple[str, list[str]]]:
    """One key a line, then its limits if any (`KEY rpm=600 tpm=200000 turns=8 weight=2`,
    gateway.front.tenants); blank lines and lines starting with # are skipped."""
    with open(path, encoding="utf-8") as f:
        lines = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
    return [(words[0], words[1:]) for words in lines]


class ApiKeys:
    """The client keys this gateway accepts; off when there are none and no file."""

    CHECK_SECONDS = 1.0  # how often the file's stat is looked at (on the request path)

    def __init__(
        self,
        keys: list[str],
        path: str = "",
        clock: Callable[[], float] = time.monotonic,
        defaults: KeyLimits = KeyLimits(),
    ) -> None:
        self._given = [_digest(k) for k in keys]
        self.path = path
        self._clock = clock
        self.defaults = defaults
        self._lock = threading.Lock()
        self._from_file: list[bytes] = []
        self._limits: dict[bytes, KeyLimits] = {}  # the file's keys with limits of their own
        self._stamp: tuple | None = None
        self._checked = float("-inf")
        if path:
            self._reload()

    @property
    def enabled(self) -> bool:
        return bool(self._given or self.path)

    def check(self, authorization: str | None) -> None:
        """Raise Unauthorized unless the header carries an accepted key (when keys are on)."""
        if not self.enabled:
            return
        if self.path and self._clock() - self._checked >= self.CHECK_SECONDS:
            self._reload()
        given = bearer(authorization)
        if not given:
            raise Unauthorized("Missing API key: send Authorization: Bearer <key>")
        if not _matches(given, self._given + self._from_file):
            raise Unauthorized("Incorrect API key provided")

    def tenant(self, authorization: str | None) -> tuple[str, KeyLimits]:
        """Who an accepted key is for limits and fair shares (the key itself, however the header
        spells it; one tenant, "", without keys) and its limits: its own line's, else the
        defaults."""
        if not self.enabled:
            return "", NO_LIMITS
        digest = _digest(bearer(authorization))
        return digest.hex()[:32], self._limits.get(digest, self.defaults)

    def _reload(self) -> None:
        """Re-read the file if it changed. Revocation fails closed: an empty, comments-only,
        deleted or unreadable file accepts none of its keys (the settings' own still work);
        write the file elsewhere and rename it in, so no reader sees it half written."""
        if not self._lock.acquire(blocking=False):
            return  # another request is looking already
        try:
            self._checked = self._clock()
            try:
                st = os.stat(self.path)
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
                if stamp == self._stamp:
                    return
                lines = read_keys(self.path)
                limits = {
                    _digest(key): KeyLimits.parse(options, self.defaults)
                    for key, options in lines
                    if options
                }
            except (OSError, ValueError) as exc:  # ValueError: not UTF-8, a bad limit
                if self._stamp is not None or self._from_file:
                    log.error(
                        "API keys file %s: %s; none of its keys is accepted until it can be read",
                        self.path,
                        getattr(exc, "strerror", None) or exc,
                    )
                self._from_file, self._limits, self._stamp = [], {}, None
                return
            keys = [key for key, _ in lines]
            if not keys:
                log.warning(
                    "API keys file %s holds no key: none of its keys is accepted", self.path
                )
            self._from_file, self._limits, self._stamp = [_digest(k) for k in keys], limits, stamp
            log.info("API keys file %s: %d keys", self.path, len(keys))
        finally:
            self._lock.release()


def check_admin(token: str, authorization: str | None, what: str) -> None:
    """The admin rule: 404 when no admin token is set (the route is off), 401 for a wrong one."""
    if not token:
        raise NotFound("Not Found")
    if not _matches(bearer(authorization), [_digest(token)]):
        raise Unauthorized(f"{what} needs Authorization: Bearer <admin token>")
