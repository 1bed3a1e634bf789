"""API keys: several at once (rotation), Bearer or X-API-Key, compared in constant time.

Keys are never logged; requests are attributed to a key *id*, the first 12 hex digits
of the key's sha256.
"""

from __future__ import annotations

import hmac

from bagserve.core.hashing import text_sha256
from fastapi import Request

from .errors import Problem

__all__ = ["ApiKeys", "key_id"]


def key_id(key: str) -> str:
    """A key's public id: the first 12 hex digits of its sha256 (logged, never the key)."""
    return text_sha256(key)[:12]


class ApiKeys:
    """The configured API keys, compared in constant time.

    Parameters
    ----------
    keys : list of str
        Accepted keys; empty turns authentication off.
    """

    def __init__(self, keys: list[str]):
        self._keys = [k.encode() for k in keys if k]
        self._ids = [key_id(k) for k in keys if k]

    @property
    def enabled(self) -> bool:
        """Keys are configured (requests need one)."""
        return bool(self._keys)

    def check(self, request: Request) -> str | None:
        """The id of the presented key; ``None`` when authentication is off.

        Raises
        ------
        Problem
            401 when the key is missing or matches none of the configured keys.
        """
        if not self._keys:
            return None
        presented = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if presented is None and auth[:7].lower() == "bearer ":
            presented = auth[7:].strip()
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
        for k, kid in zip(self._keys, self._ids, strict=True):
            if hmac.compare_digest(candidate, k):
                match = kid
        if match is None:
            raise Problem(
                401, "the API key is not valid", headers=challenge, slug="invalid-api-key"
            )
        return match
