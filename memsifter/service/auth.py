"""API keys by reference: the config names environment variables, the keys are their values.

``auth.keys`` (and ``auth.keys_file``) map an environment variable's NAME to a :class:`Grant` (the ids it
may read and write). At start every named variable must be set (a missing one is a one-line error naming
the variable, never a value); a request's key is compared with each key in constant time. No key: the
``anonymous`` grant if there is one, else 401; a key that is not known: 401; a known key asking for an id
outside its grant: 403. Key values join :func:`memsifter.security.redact.redact`'s secrets, so no log line or
response carries one.
"""

from __future__ import annotations

import fnmatch
import hmac
import json
import os
from dataclasses import dataclass

from ..store import storage
from ..errors import ConfigError
from .config import AuthConfig, Grant

MIN_KEY_CHARS = 16


class Unauthorized(Exception):
    """No key, or a key that is not known (401)."""


class Forbidden(Exception):
    """A known key asking for an id outside its grant (403)."""


@dataclass
class Principal:
    """Who is asking: a key's env var name (never its value) or ``anonymous``, and what they may do."""

    name: str
    grant: Grant

    def can(self, action: str, item: str) -> bool:
        pats = self.grant.read if action == "read" else self.grant.write
        return any(fnmatch.fnmatchcase(item, p) for p in pats)

    def require(self, action: str, item: str) -> None:
        if not self.can(action, item):
            raise Forbidden(f"this key may not {action} '{item}'")


class Keys:
    """The keys in effect (loaded once at start; a changed Secret takes a restart, as for any env var)."""

    def __init__(self, cfg: AuthConfig):
        grants = dict(cfg.keys)
        if cfg.keys_file:
            grants.update(_read_keys_file(cfg.keys_file))
        self.anonymous = cfg.anonymous
        self._keys: list[tuple[bytes, Principal]] = []
        for name, grant in grants.items():
            value = os.environ.get(name)
            if not value:
                raise ConfigError(f"serve: auth key variable {name} is not set (set it from the Secret that holds "
                                  "the key)")
            if len(value) < MIN_KEY_CHARS:
                raise ConfigError(f"serve: the key in {name} is shorter than {MIN_KEY_CHARS} characters")
            self._keys.append((value.encode(), Principal(name, grant)))
        self.env_names = list(grants)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def secrets(self) -> list[str]:
        return [k.decode() for k, _ in self._keys]

    def principal(self, authorization: str | None, x_api_key: str | None) -> Principal:
        """The caller of a request with these headers (:class:`Unauthorized` when none may be named)."""
        key = None
        if x_api_key:
            key = x_api_key.strip()
        elif authorization:
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthorized("Authorization must be 'Bearer <key>'")
            key = value.strip()
        if not key:
            if self.anonymous is not None:
                return Principal("anonymous", self.anonymous)
            raise Unauthorized("no API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
        given = key.encode("utf-8", "replace")
        found = None
        for value, principal in self._keys:   # every key compared: time does not depend on which matched
            if hmac.compare_digest(value, given):
                found = principal
        if found is None:
            raise Unauthorized("unknown API key")
        return found


def _read_keys_file(uri: str) -> dict[str, Grant]:
    import yaml

    try:
        raw = storage.read_text(uri)
        data = json.loads(raw) if uri.endswith(".json") else yaml.safe_load(raw)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - unreadable or not JSON/YAML: one line
        raise ConfigError(f"serve: auth.keys_file {uri}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"serve: auth.keys_file {uri}: expected a mapping of env var name -> grant")
    cfg = AuthConfig.model_validate({"keys": data})
    return dict(cfg.keys)
