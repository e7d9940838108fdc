"""No credential in a log line: a filter that passes every record of the service's loggers (and the
servers it runs under) through :func:`memsifter.security.redact.redact`, with the API keys and an endpoint's key
as known secrets."""

from __future__ import annotations

import logging
from typing import Iterable

from ..security.redact import redact

LOGGERS = ("memsifter", "memsifter.service", "memsifter.models.llm", "uvicorn", "uvicorn.access", "uvicorn.error", "fastapi", "ray.serve")


class RedactingFilter(logging.Filter):
    def __init__(self, secrets: Iterable[str]):
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose args do not format: leave it to logging
            return True
        clean = redact(msg, self.secrets)
        if clean != msg or record.args:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            record.msg = f"{record.msg}\n{redact(text, self.secrets)}"
            record.exc_info, record.exc_text = None, None
        return True


def install_redaction(secrets: Iterable[str]) -> RedactingFilter:
    """Add the filter to the service's loggers and to every handler of the root logger."""
    f = RedactingFilter(secrets)
    for name in LOGGERS:
        lg = logging.getLogger(name)
        if not any(isinstance(x, RedactingFilter) for x in lg.filters):
            lg.addFilter(f)
    for h in logging.getLogger().handlers:
        if not any(isinstance(x, RedactingFilter) for x in h.filters):
            h.addFilter(f)
    return f
