"""Where a remote tier is: its URL (``redis://``, ``rediss://`` with TLS
files, ``unix://``), credentials from the URL or the environment, shown
redacted; and the namespace as it appears in key names."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ...errors import RemoteConfigError

PASSWORD_ENV = ("KVSTORE_REMOTE_PASSWORD", "REDISCLI_AUTH")  # first set wins, when the URL has none
USER_ENV = "KVSTORE_REMOTE_USER"
SCHEMES = ("redis", "rediss", "unix")
# rediss:// URL parameters (redis-py's names): the CA that signed the server's certificate (else the system's),
# and a client certificate and key where the server asks for one (tls-auth-clients)
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_SAFE_NS = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def namespace_tag(namespace: Optional[str]) -> str:
    """The namespace as it appears in key names ("-" for none; a digest for names with characters Redis
    patterns or hashtags would misread)."""
    if namespace is None:
        return "-"
    if _SAFE_NS.fullmatch(namespace):
        return namespace
    import xxhash

    return "h" + xxhash.xxh3_64_hexdigest(namespace.encode())


@dataclass(frozen=True)
class RemoteURL:
    """A parsed ``redis://``, ``rediss://`` (TLS; ``?ssl_ca_certs=/path/ca.pem`` and the other ``TLS_FILES``)
    or ``unix://`` URL. TLS always verifies the server's certificate and host name."""

    scheme: str
    host: Optional[str]
    port: int
    db: int
    socket_path: Optional[str]
    username: Optional[str]
    password: Optional[str]
    shown: str  # the URL without its password, for messages
    tls: tuple[tuple[str, str], ...] = ()  # TLS_FILES given, as (parameter, path)

    @classmethod
    def parse(cls, url: str) -> "RemoteURL":
        """Raises ``RemoteConfigError`` naming what is wrong (never the password).

        >>> RemoteURL.parse("redis://:secret@cache:6380/2").shown
        'redis://:***@cache:6380/2'
        """
        u, port, shown, scheme = _split(url)
        tls, db_text = _query(u.query, scheme, shown)
        host, path = None, None
        if scheme == "unix":
            path = unquote(u.path)
            if not path:
                raise RemoteConfigError(f"remote URL {shown}: no socket path (unix:///run/redis.sock)")
        else:
            host = u.hostname
            if not host:
                raise RemoteConfigError(f"remote URL {shown}: no host (redis://host:6379/0)")
            if u.path not in ("", "/"):
                db_text = u.path.lstrip("/")
        username, password = _credentials(u)
        return cls(scheme, host, port or 6379, _db(db_text, shown), path, username, password, shown, tls)


def _split(url: str):
    """``url`` split (``urlsplit``'s result), its port (None if not given), the URL shown redacted, and its
    scheme, one of ``SCHEMES``."""
    if not isinstance(url, str) or not url:
        raise RemoteConfigError(f"remote must be a URL like redis://host:6379/0, got {url!r}")
    try:
        u = urlsplit(url)
        port = u.port  # (a port out of range or not a number raises here)
    except ValueError as e:
        raise RemoteConfigError(f"remote URL {_redact_raw(url)} is malformed: {e}") from None
    shown = _redacted(u)
    scheme = u.scheme.lower()
    if scheme not in SCHEMES:
        raise RemoteConfigError(f"remote URL {shown}: scheme must be one of {', '.join(SCHEMES)}, "
                                f"e.g. redis://host:6379/0")
    return u, port, shown, scheme


def _query(text: str, scheme: str, shown: str) -> tuple[tuple[tuple[str, str], ...], Optional[str]]:
    """The URL's parameters: the TLS files (each an existing file, TLS only) and the ``db`` given, if any."""
    query = parse_qs(text, keep_blank_values=True)
    unknown = sorted(set(query) - {"db", *TLS_FILES})
    if unknown:
        raise RemoteConfigError(f"remote URL {shown}: unknown parameter(s) {', '.join(unknown)} "
                                f"(known: db, {', '.join(TLS_FILES)})")
    tls = tuple((name, query[name][-1]) for name in TLS_FILES if name in query)
    if tls and scheme != "rediss":
        raise RemoteConfigError(f"remote URL {shown}: {tls[0][0]} applies to TLS only (rediss://)")
    for name, path in tls:
        if not os.path.isfile(path):
            raise RemoteConfigError(f"remote URL {shown}: {name}: no such file {path!r}")
    return tls, query["db"][-1] if "db" in query else None


def _db(db_text: Optional[str], shown: str) -> int:
    """The database number (0 when none is given)."""
    try:
        db = 0 if db_text in (None, "") else int(db_text)
        if db < 0:
            raise ValueError
    except ValueError:
        raise RemoteConfigError(f"remote URL {shown}: database must be a number >= 0, "
                                f"got {db_text!r}") from None
    return db


def _credentials(u) -> tuple[Optional[str], Optional[str]]:
    """User name and password: the URL's, else the environment's (``USER_ENV``, ``PASSWORD_ENV``)."""
    username = unquote(u.username) if u.username else os.environ.get(USER_ENV) or None
    password = unquote(u.password) if u.password else next(
        (os.environ[v] for v in PASSWORD_ENV if os.environ.get(v)), None)
    return username, password


def _redacted(u) -> str:
    if u.password is None:
        return u.geturl()
    user = quote(unquote(u.username or ""), safe="")
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{u.port}" if u.port else ""
    except ValueError:
        port = ""
    return u._replace(netloc=f"{user}:***@{host}{port}").geturl()


def _redact_raw(url: str) -> str:
    """Best effort for a URL that does not even parse: drop what looks like userinfo."""
    return re.sub(r"//[^@/]*@", "//***@", url)
