"""API keys by reference: the config names environment variables, the keys are their values.

``auth.keys`` (and ``auth.keys_file``) map an environment variable's NAME to a :class:`Grant` (the ids it
may read and write). At start every named variable must be set (a missing one is a one-line error naming
the variable, never a value); a request's key is compared with each key in constant time. No key: the
``anonymous`` grant if the config gives one explicitly, else 401 (on every route but the probes and the API
description: :data:`PUBLIC_PATHS`); a key that is not known: 401; a known key asking for an id outside its
grant: 403. A variable that holds something other than a key (``PATH``, a file path, words with spaces) is
refused at start (:func:`check_key`): a key is one token of at least 16 characters. Key values join :func:`memsifter.security.redact.redact`'s secrets, so no log line or
response carries one.
"""

from __future__ import annotations

import fnmatch
import hmac
import json
import os
import re
from dataclasses import dataclass

from ..store import storage
from ..errors import ConfigError
from .config import AuthConfig, Grant

MIN_KEY_CHARS = 16
MIN_KEY_DISTINCT = 8
# A bearer token's characters (RFC 6750 b64token): no space, ':', quote or control character.
KEY_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
PATH_RE = re.compile(r"^(/|~/|\./|\.\./)[\w.-]+(/[\w.-]*)+$")   # /a/b, ~/a/b, ./a/b: a path, not a key
# Variables every shell or container sets, never an API key.
NOT_KEYS = frozenset("""PATH HOME USER LOGNAME SHELL PWD OLDPWD LANG LANGUAGE TERM HOSTNAME TMPDIR TEMP TMP MAIL
EDITOR VISUAL PAGER DISPLAY PYTHONPATH PYTHONHOME VIRTUAL_ENV LD_LIBRARY_PATH LD_PRELOAD MANPATH INFOPATH
XDG_RUNTIME_DIR XDG_CONFIG_HOME XDG_DATA_HOME XDG_CACHE_HOME SSH_AUTH_SOCK HF_HOME KUBECONFIG RAY_ADDRESS
CONDA_PREFIX JAVA_HOME GOPATH CARGO_HOME""".split())
# Routes without a key even when keys are set: the probes (status only, no detail without a key) and the
# API's own description (no data). Everything else, unknown paths included, is 401 without a key.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json"})


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS


def check_key(name: str, value: str | None) -> str:
    """The key held by variable ``name``, or a one-line :class:`ConfigError` saying why it is not one (never
    the value)."""
    if name in NOT_KEYS:
        raise ConfigError(f"serve: auth.keys.{name}: {name} is a system variable, not an API key (name the "
                          "variable that holds the key, e.g. MEMSIFTER_KEY_<TENANT>)")
    if not value:
        raise ConfigError(f"serve: auth key variable {name} is not set (set it from the Secret that holds "
                          "the key)")
    if len(value) < MIN_KEY_CHARS:
        raise ConfigError(f"serve: the key in {name} is shorter than {MIN_KEY_CHARS} characters")
    if not KEY_RE.match(value) or len(set(value)) < MIN_KEY_DISTINCT:
        raise ConfigError(f"serve: auth.keys.{name}: its value is not an API key (a key is one token "
                          f"of letters, digits and -._~+/=, at least {MIN_KEY_DISTINCT} different characters; "
                          "e.g. `openssl rand -hex 32`)")
    if PATH_RE.match(value) or os.path.exists(os.path.expanduser(value)):
        raise ConfigError(f"serve: auth.keys.{name}: the variable holds a file path, not an API key")
    return value


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
            value = check_key(name, os.environ.get(name))
            self._keys.append((value.encode(), Principal(name, grant)))
        self.env_names = list(grants)

    def readers(self, item: str) -> list[str]:
        """The variables whose key may read ``item``."""
        return [p.name for _, p in self._keys if p.can("read", item)]

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
