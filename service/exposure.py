"""Anonymous access on an address other machines reach: the start-up warning and /readyz.

Without API keys every caller may predict, read the audit trail and administer models.
That is right on a developer's loopback address, or behind a gateway that
authenticates; on any other address (the image listens on 0.0.0.0) it is most often a
forgotten setting, so the service says so, at start and in ``/readyz``, until keys are
set or ``BAGSERVE_ALLOW_ANONYMOUS=true`` says it is meant.
"""

from __future__ import annotations

import ipaddress

from .settings import Settings

__all__ = ["anonymous_exposure", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reached from this machine only.

    Parameters
    ----------
    host : str
        The address the service listens on: an IPv4 or IPv6 address (brackets allowed)
        or a host name.

    Returns
    -------
    bool
        True for 127.0.0.0/8, ::1 (also IPv4-mapped, ::ffff:127.x.y.z), ``localhost``
        and names under ``.localhost`` (RFC 6761 keeps them on the loopback interface).
        False for everything else: the wildcard addresses, other addresses, and other
        names, whatever they resolve to today.
    """
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        # Python 3.11's is_loopback is False for ::ffff:127.0.0.1.
        address = address.ipv4_mapped
    return address.is_loopback


def anonymous_exposure(settings: Settings) -> str | None:
    """The warning for anonymous access on a non-loopback address, or None.

    Parameters
    ----------
    settings : Settings
        The service's settings: ``host``, ``api_keys`` and ``allow_anonymous`` decide.

    Returns
    -------
    str or None
        One sentence naming the address and both ways out (API keys, or
        ``BAGSERVE_ALLOW_ANONYMOUS=true``); None when keys are set, the address is a
        loopback one, or anonymous access was allowed explicitly.
    """
    if settings.api_keys or settings.allow_anonymous or is_loopback(settings.host):
        return None
    return (
        f"anonymous access on a public address: the service listens on {settings.host} "
        "and no API key is configured, so anyone who reaches it may predict and administer "
        "models; set BAGSERVE_API_KEYS (KEY or ROLE:KEY entries, comma-separated), or "
        "BAGSERVE_ALLOW_ANONYMOUS=true behind a gateway that authenticates"
    )
