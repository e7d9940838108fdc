"""Errors that the CLI turns into one clear line and a non-zero exit.

Every error a user can cause by giving bad input is a :class:`MemsifterError`. Input errors carry
where the problem is: the file (URI), the item (question / conversation id or row number) and the
field, so a message reads ``file.json: question 'q17': field 'answer_session_ids': ...``.
"""

from __future__ import annotations


class MemsifterError(Exception):
    """Base class of user-facing errors (exit code 2)."""

    exit_code = 2


class InputError(MemsifterError):
    """Bad input data: names file, item and field."""

    def __init__(self, message: str, *, file: str | None = None, item: str | None = None,
                 field: str | None = None):
        self.file, self.item, self.field, self.detail = file, item, field, message
        parts = [p for p in (file, item, f"field '{field}'" if field else None) if p]
        super().__init__(": ".join(parts + [message]))


class StorageError(MemsifterError):
    """A URI that cannot be read or written (missing, unreadable, bad credentials)."""


class NotPublishedError(StorageError):
    """A dataset without a ``_SUCCESS`` manifest: it was never published or is half-written."""


class ConfigError(MemsifterError):
    """A stage configuration that does not validate."""
