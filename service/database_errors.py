"""The errors of the shared state's database, apart from both of its drivers.

:mod:`bagserve.service.database` (SQLite, and the choice of driver) and
:mod:`bagserve.service.postgres` (PostgreSQL, loaded only when configured) both raise
them, so neither has to import the other to do so.
"""

from __future__ import annotations

__all__ = ["DatabaseError", "DatabaseTimeout"]


class DatabaseError(RuntimeError):
    """The database cannot be opened or migrated (the message says which and why)."""


class DatabaseTimeout(RuntimeError):
    """The database did not answer within the deadline (a frozen server, every
    connection busy): nothing of the call is known to be done."""
