"""One redaction for every text that can leave a process: errors, log lines, stats, published columns.

An endpoint's URL can carry ``user:password@``; an OpenAI-compatible server may echo the request's
``Authorization`` header in its error body ("Incorrect API key provided: Bearer sk-…"); an exception
may quote an environment value. Whatever of that reaches a ``reason`` column, a manifest's stats, a
failure record or a log is published or archived, so it passes through :func:`redact` first.

:data:`PATTERNS` are the token shapes :mod:`memsifter.security.secretscan` looks for too (one place for the
patterns): what the scanner would report, redaction removes.

The process remembers the credentials it meets (:func:`remember`): a key read from the variable a config
names, a URL's ``user:password@`` (taken out when the config is parsed, :func:`bare_url`, and sent by the
HTTP clients as the request's auth, :func:`url_auth`). Every redaction removes them in all their forms
(:func:`forms`: percent-encoded, JSON-escaped, base64 as in a Basic header), and a publication refuses a
file that still holds one (:class:`memsifter.store.storage.Publication`).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import threading
from typing import Any, Iterable
from urllib.parse import quote

MASK = "***"

_B = r"(?<![A-Za-z0-9_/+-])"  # not inside a longer token
_E = r"(?![A-Za-z0-9_/+-])"
# (kind, pattern): group 1 is the secret itself.
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("aws-access-key-id", re.compile(_B + r"((?:AKIA|ASIA|ABIA|ACCA|AIDA|AROA|AIPA|ANPA|ANVA|APKA)[A-Z0-9]{16})" + _E)),
    # in an assignment (KEY=v, key: v, "key": v) or a Kubernetes env entry (name: KEY / value: v, also as JSON)
    ("aws-secret-access-key", re.compile(
        r"(?i)secret_?(?:access_?)?key[\"']?\s*(?:[:=]|,\s*[\"']?value[\"']?\s*:|\n\s*[\"']?value[\"']?\s*:)"
        r"\s*[\"']?([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])")),
    ("openai-api-key", re.compile(_B + r"(sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,})" + _E)),
    ("huggingface-token", re.compile(_B + r"(hf_[A-Za-z0-9]{30,})" + _E)),
    ("github-token", re.compile(_B + r"((?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{60,})" + _E)),
    ("private-key", re.compile(r"(-----BEGIN (?:RSA |EC |DSA |OPENSSH |ENCRYPTED |PGP )?PRIVATE KEY(?: BLOCK)?-----)")),
]

# A quick first pass: every match of PATTERNS contains one of these words, so a text without any cannot
# hold a token shape (an AWS secret key's name is looked for as secret, Secret or SECRET: the only casings
# met in practice). Keep in step with PATTERNS. HINT is the same as an RE2 pattern (Arrow's compute, over
# whole columns).
HINT_WORDS = ("sk-", "AKIA", "ASIA", "ABIA", "ACCA", "AIDA", "AROA", "AIPA", "ANPA", "ANVA", "APKA", "hf_", "ghp_",
              "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "PRIVATE KEY", "secret", "Secret", "SECRET")
HINT = "|".join(HINT_WORDS)

# Shapes that only redaction needs (the scanner would report them on every log line that names them):
# credentials in a URL, an Authorization header's value, a key/token/password assignment.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/@\s?#]*)@")
_AUTH_VALUE = re.compile(r"\b((?i:bearer)|Basic)(?:\s+|%20)[A-Za-z0-9._~+/=:-]{6,}")
_ASSIGNED = re.compile(r"(?i)((?:api[_-]?key|x-api-key|access[_-]?token|auth[_-]?token|secret[_-]?(?:access[_-]?)?key"
                       r"|session[_-]?token|password|passwd|authorization)[\"']?\s*[:=]\s*[\"']?)"
                       r"(?!\*\*\*)([^\s\"',;&}]{4,})")
# Environment variables whose values are secrets whatever their shape: the names the platform reads
# (the API key variable an endpoint names is passed in by its caller) and anything named like a secret.
_SECRET_ENV = ("OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_SECRET_NAME = re.compile(r"(?i)(?:^|_)(?:API_?KEY|SECRET|TOKEN|PASSWORD|PASSWD)(?:_|$)")
_MIN_SECRET = 6  # shorter env values ("1", "true", "EMPTY"...) are not worth hiding and would mangle text


# Credentials this process has met (keys read from the variables a config names, a URL's user:password),
# with their encoded forms: every redact() removes them, and a publication refuses a file that holds one.
_KNOWN: set[str] = set()
_AUTH: dict[str, tuple[str, str]] = {}   # bare URL -> (user, password) it was given with
_lock = threading.Lock()


@functools.lru_cache(maxsize=1024)
def forms(secret: str) -> tuple[str, ...]:
    """How a secret can appear in text: as it is, percent-encoded (a URL), JSON-escaped and in base64
    (a Basic header is base64 of ``user:password``; without its padding, so a padded or cut form is
    found too)."""
    out = {secret, quote(secret, safe=""), json.dumps(secret, ensure_ascii=False)[1:-1],
           json.dumps(secret)[1:-1]}
    if len(secret) >= 4:
        out.add(base64.b64encode(secret.encode()).decode().rstrip("="))
    return tuple(sorted((f for f in out if len(f) >= 4), key=len, reverse=True))


def remember(*secrets: str | None) -> None:
    """Make ``secrets`` known to every later :func:`redact` of this process (and to the publications'
    secret check, :func:`known_secrets`). Values shorter than 6 characters are not remembered: hiding
    every "test" of every published text would mangle it (a URL's ``user:pass`` is still remembered whole,
    and so is its Basic form)."""
    new = [s for s in secrets if s and len(s) >= _MIN_SECRET and s not in _KNOWN]
    if new:
        with _lock:
            _KNOWN.update(new)


def known_secrets(secrets: Iterable[str | None] = (), env: bool = True) -> list[str]:
    """Every form (:func:`forms`) of ``secrets``, of the credentials remembered by this process and (with
    ``env``) of :func:`env_secrets`: longest first, so that a value containing another is removed whole."""
    with _lock:
        values = set(_KNOWN)
    values |= {s for s in secrets if s and len(s) >= 4}
    if env:
        values |= set(env_secrets())
    return sorted({f for s in values for f in forms(s)}, key=len, reverse=True)


def bare_url(url: str | None) -> str | None:
    """``url`` without its ``user:password@``: what a config stores and every message shows. The
    credentials are remembered (redacted everywhere from now on) and kept for :func:`url_auth`, which
    the HTTP clients send them with; a URL without them is returned as it is."""
    if not url or "@" not in url:
        return url
    try:
        bare, cred = strip_userinfo(url)
    except ValueError:   # not a URL (a bad port, a broken IPv6 host): its validation says so
        return url
    if cred is None:
        return url
    user, password = cred
    # with a password, user:password (its base64 is the Basic header) and the password; without one, the
    # user may be a token (https://TOKEN@host)
    remember(*((f"{user}:{password}", password) if password else (user, f"{user}:")))
    with _lock:
        _AUTH[bare] = cred
    return bare


def url_auth(url: str | None) -> tuple[str, str] | None:
    """The (user, password) that :func:`bare_url` took out of ``url`` (or that ``url`` still carries),
    for a client to send as Basic auth; None when there were none."""
    if not url:
        return None
    bare = bare_url(url)
    with _lock:
        return _AUTH.get(bare)


def redact_known(text: Any, secrets: Iterable[str | None] = ()) -> Any:
    """``text`` without the credentials this process knows (:func:`known_secrets`, all their forms) and
    ``secrets``; nothing else is touched (ordinary text that merely looks like a key stays): for answers a
    server sent, which may quote the request's Authorization header."""
    if not isinstance(text, str) or not text:
        return text
    for s in known_secrets(secrets):
        if s in text:
            text = text.replace(s, MASK)
    return text


def env_secrets(names: Iterable[str | None] = ()) -> list[str]:
    """Values of the environment variables that hold secrets: ``names`` (e.g. an endpoint's
    ``api_key_env``), the well-known ones and any variable named like a key, token or password."""
    wanted = {n for n in names if n} | set(_SECRET_ENV)
    out = []
    for name, value in os.environ.items():
        if (name in wanted or _SECRET_NAME.search(name)) and value and len(value) >= _MIN_SECRET:
            out.append(value)
    return out


def _userinfo(m: re.Match) -> str:
    info = m.group(2)
    if not info:
        return m.group(0)
    user, sep, _ = info.partition(":")
    return f"{m.group(1)}{user}:{MASK}@" if sep else f"{m.group(1)}{MASK}@"


def redact(text: Any, secrets: Iterable[str | None] = (), env: bool = True) -> Any:
    """``text`` without credentials: a URL's ``user:password@`` (the password, or a token given as the
    user), ``Bearer``/``Basic`` header values, ``api_key=…``-style assignments, the token shapes of
    :data:`PATTERNS`, and every form (:func:`forms`) of ``secrets``, of the credentials this process
    remembered (:func:`remember`, :func:`bare_url`) and (with ``env``) of :func:`env_secrets`. Anything
    that is not a string is returned as it is (``None`` stays ``None``)."""
    if not isinstance(text, str) or not text:
        return text
    for s in known_secrets(secrets, env):  # longest first: a value that contains another is removed whole
        if s in text:
            text = text.replace(s, MASK)
    text = _URL_USERINFO.sub(_userinfo, text)
    text = _AUTH_VALUE.sub(lambda m: f"{m.group(1)} {MASK}", text)
    text = _ASSIGNED.sub(lambda m: m.group(1) + MASK, text)
    for _, rx in PATTERNS:
        text = rx.sub(lambda m: m.group(0).replace(m.group(1), MASK), text)
    return text


def redact_obj(obj: Any, secrets: Iterable[str | None] = ()) -> Any:
    """:func:`redact` over every string of a JSON-like value (stats dicts, lists), keys included."""
    secrets = list(secrets)
    if isinstance(obj, str):
        return redact(obj, secrets)
    if isinstance(obj, dict):
        return {redact_obj(k, secrets): redact_obj(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v, secrets) for v in obj)
    return obj


def strip_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its ``user:password@`` and the (user, password) it carried (percent-decoded),
    so that a client can send them as a header while every log line and error names the bare URL."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    info, _, host = parts.netloc.rpartition("@")
    user, _, password = info.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))
