"""API keys: tenants with a role, Bearer or X-API-Key, compared in constant time.

Keys are never logged; requests are attributed to a key *id*, the first 12 hex digits
of the key's sha256. Each key is a tenant: the jobs, idempotency records and audit
entries it makes are its own, and other keys do not see them. Each key has a role:

* ``read``: model descriptions, its own jobs and audit entries, statistics;
* ``predict`` (a key written without a role): also predictions and jobs;
* ``admin``: also loading and unloading models, and every tenant's jobs.

``BAGSERVE_API_KEYS`` lists keys as ``KEY`` or ``ROLE:KEY`` (e.g.
``admin:9f2c...,predict:77ab...``).
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

from bagserve.core.hashing import text_sha256
from fastapi import Request

from .errors import Problem

__all__ = ["ANONYMOUS", "ApiKeys", "Principal", "Role", "key_id"]


class Role(enum.IntEnum):
    """What a key may do; each role may do everything the ones below it may."""

    READ = 1
    PREDICT = 2
    ADMIN = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Principal:
    """Who is asking: the key's id (None without keys) and its role."""

    key_id: str | None
    role: Role

    def may(self, role: Role) -> bool:
        return self.role >= role

    def owns(self, owner: str | None) -> bool:
        """Whether something made by the key ``owner`` is this caller's to see: its own,
        or anything for an admin (and everything when the service has no keys)."""
        return self.role is Role.ADMIN or owner == self.key_id


#: The caller when the service runs without keys: one tenant that may do everything.
ANONYMOUS = Principal(None, Role.ADMIN)


def key_id(key: str) -> str:
    """A key's public id: the first 12 hex digits of its sha256 (logged, never the key)."""
    return text_sha256(key)[:12]


def _parse(entry: str) -> tuple[str, Role]:
    """``KEY`` or ``ROLE:KEY`` (a key that itself starts with a role name and a colon
    must be written with its role)."""
    role, sep, key = entry.partition(":")
    if sep and role.strip().lower() in {str(r) for r in Role}:
        return key.strip(), Role[role.strip().upper()]
    return entry.strip(), Role.PREDICT


class ApiKeys:
    """The configured API keys and their roles, compared in constant time.

    Parameters
    ----------
    keys : list of str
        Accepted keys, each ``KEY`` or ``ROLE:KEY``; empty turns authentication off.
    """

    def __init__(self, keys: list[str]):
        parsed = [_parse(k) for k in keys if k.strip()]
        self._keys = [k.encode() for k, _ in parsed if k]
        self._ids = [key_id(k) for k, _ in parsed if k]
        self._roles = [r for k, r in parsed if k]

    @property
    def enabled(self) -> bool:
        """Keys are configured (requests need one)."""
        return bool(self._keys)

    @staticmethod
    def presented(request: Request) -> str | None:
        """The key a request presents (``X-API-Key`` or a bearer token), if any."""
        presented = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if presented is None and auth[:7].lower() == "bearer ":
            presented = auth[7:].strip()
        return presented or None

    def check(self, request: Request) -> Principal:
        """The caller of ``request``; :data:`ANONYMOUS` when authentication is off.

        Raises
        ------
        Problem
            401 when the key is missing or matches none of the configured keys.
        """
        if not self._keys:
            return ANONYMOUS
        presented = self.presented(request)
        challenge = {"WWW-Authenticate": 'Bearer realm="bagserve"'}
        if not presented:
            raise Problem(
                401,
                "an API key is required (Authorization: Bearer, or X-API-Key)",
                headers=challenge,
                slug="missing-api-key",
            )
        candidate = presented.encode()
        match = None
        # Compare with every key, without stopping early, in constant time each.
        for k, kid, role in zip(self._keys, self._ids, self._roles, strict=True):
            if hmac.compare_digest(candidate, k):
                match = Principal(kid, role)
        if match is None:
            raise Problem(
                401, "the API key is not valid", headers=challenge, slug="invalid-api-key"
            )
        return match
