"""The one owner of `REDIS_URL`: a plain Redis URL, or a Sentinel URL, turned into clients and Celery settings.

Accepted forms (every process of the fleet reads the same one):

    redis://[[user]:password@]host:port/db          one Redis (also ElastiCache's primary endpoint)
    rediss://...                                     the same over TLS
    unix:///path/redis.sock?db=0                     a local socket
    sentinel://[[user]:password@]host:port[,host:port...][/db]?master=NAME
                                                     Redis Sentinel: the sentinels to ask, and the name
                                                     of the master they watch (`master` is required)

In a Sentinel URL the user and password are the Redis master's (the sentinels themselves are asked
without auth; TLS is not offered over Sentinel), `db` defaults to 0 and a sentinel's port to 26379.
Every client asks the sentinels for the current master when it connects, and again after a
connection to it fails, so API, workers and Flower follow a failover without a restart.

Celery spells Sentinel differently (`sentinel://h1:26379/0;sentinel://h2:26379/0` plus the
transport option `master_name`, for the broker and the result backend separately): `celery_target`
translates, so nothing else in the fleet parses a URL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "sentinel://"
SCHEMES = ("redis://", "rediss://", "unix://", SENTINEL_SCHEME)
SENTINEL_PORT = 26379
FORM = "redis://, rediss:// or unix:// URL, or sentinel://[:password@]host:port[,host:port...][/db]?master=NAME"


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed `sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    def credentials(self) -> dict[str, Any]:
        """The master's `username`/`password` keyword arguments (only those set)."""
        return {k: v for k, v in (("username", self.username), ("password", self.password)) if v}


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:26379
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"bad sentinel address {text!r} in {redact(url)}")
    return host, int(port) if port else SENTINEL_PORT


def _split(url: str) -> tuple[str, str, str]:
    """A URL's netloc, path and query. Not `urlsplit`: patched Pythons (Debian's 3.11.2 here, and the
    2025 security releases) refuse a netloc with anything before an IPv6 bracket, which a list of
    sentinels has."""
    rest = url.partition("://")[2].partition("#")[0]
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    return netloc, slash + path, query


def parse_sentinel(url: str) -> SentinelUrl | None:
    """The Sentinel URL's parts; None for a plain Redis URL; ValueError if malformed."""
    if not url.startswith(SENTINEL_SCHEME):
        return None
    netloc, path, query = _split(url)
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    sentinels = tuple(_host_port(h.strip(), url) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise ValueError(f"no sentinel address in {redact(url)}")
    path = path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"the database of {redact(url)} must be a number")
    master = parse_qs(query).get("master", [""])[0]
    if not master:
        raise ValueError(f"{redact(url)} names no master: add ?master=NAME (the name the sentinels monitor)")
    return SentinelUrl(sentinels, master, int(path or 0), unquote(username) or None, unquote(password) or None)


def check(url: str, setting: str) -> None:
    """ValueError naming `setting` unless `url` is one of the accepted forms."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"{setting} must be a {FORM}")
    try:
        parse_sentinel(url)
    except ValueError as exc:
        raise ValueError(f"{setting}: {exc}") from None


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    netloc = _split(url)[0]
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return url.replace(netloc, f"{userinfo.partition(':')[0]}:***@{hosts}", 1)


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client of the Redis at `url` (of the current master, for a Sentinel URL).
    `kwargs` are redis-py connection options (`socket_timeout`...), used for the sentinels too."""
    target = parse_sentinel(url)
    if target is None:
        return redis.Redis.from_url(url, **kwargs)
    sentinel = Sentinel(list(target.sentinels), db=target.db, **kwargs)  # type: ignore[no-untyped-call]
    return sentinel.master_for(target.master, **target.credentials())  # type: ignore[no-untyped-call,no-any-return]


class _BlockingSentinelPool(AsyncSentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's master pool that, like `BlockingConnectionPool`, waits up to `timeout` for a free
    connection instead of failing at `max_connections`."""


def async_client(url: str, *, max_connections: int | None = None, pool_timeout: float | None = None,
                 **kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the Redis at `url`. With `max_connections`, its pool blocks (up to
    `pool_timeout`) for a free connection when all are in use, as the API wants under a burst."""
    target = parse_sentinel(url)
    if target is None:
        if max_connections is None:
            return aioredis.Redis.from_url(url, **kwargs)
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_timeout,
                                                        **kwargs)
        return aioredis.Redis(connection_pool=pool)
    sentinel = AsyncSentinel(list(target.sentinels), db=target.db, **kwargs)  # type: ignore[no-untyped-call]
    if max_connections is None:
        return sentinel.master_for(target.master, **target.credentials())  # type: ignore[no-untyped-call,no-any-return]
    return sentinel.master_for(  # type: ignore[no-untyped-call,no-any-return]
        target.master, connection_pool_class=_BlockingSentinelPool, max_connections=max_connections,
        timeout=pool_timeout, **target.credentials())


@dataclass(frozen=True)
class CeleryTarget:
    """What Celery needs for the broker and the result backend at one `REDIS_URL`."""

    url: str
    """The broker and backend URL in Celery's spelling."""
    transport_options: dict[str, Any]
    """Extra `broker_transport_options` and `result_backend_transport_options` (the master's name)."""
    sentinel: bool
    backend_url: str = ""
    """The result backend's URL alone, for a backend class named with it (`<class>+<url>`): `url` unless
    that carries a transport prefix (a socket's `redis+socket://`)."""

    def __post_init__(self) -> None:
        if not self.backend_url:
            object.__setattr__(self, "backend_url", self.url)


UNIX_SCHEME = "unix://"
SOCKET_TRANSPORT = "redis+socket://"
"""kombu's spelling of a Redis on a Unix socket (it knows no `unix://`); Celery's backend takes the part
after `redis+`."""


def _unix_target(url: str) -> CeleryTarget:
    """`unix:///path.sock?db=N` (redis-py's form) as Celery spells it: `redis+socket:///path.sock`, with
    the database as `virtual_host` (what kombu and Celery's backend read on a socket)."""
    netloc, path, query = _split(url)
    params = parse_qs(query)
    db = params.pop("db", ["0"])[0]
    rest = "".join(f"&{quote(k, safe='')}={quote(v, safe='')}" for k, vs in params.items() for v in vs)
    spelled = f"{SOCKET_TRANSPORT}{netloc}{path}?virtual_host={quote(db, safe='')}{rest}"
    return CeleryTarget(spelled, {}, False, backend_url=spelled.removeprefix("redis+"))


TLS_SCHEME = "rediss://"


def _verified(url: str) -> str:
    """A `rediss://` URL with `ssl_cert_reqs=required` unless it sets that parameter itself: what
    redis-py (the API's clients) does by default, where Celery's backend refuses a `rediss://` URL
    without it and kombu's broker then skips certificate checks."""
    if "ssl_cert_reqs=" in _split(url)[2]:
        return url
    return url + ("&" if "?" in url else "?") + "ssl_cert_reqs=required"


def celery_target(url: str) -> CeleryTarget:
    if url.startswith(UNIX_SCHEME):
        return _unix_target(url)
    if url.startswith(TLS_SCHEME):
        return CeleryTarget(_verified(url), {}, False)
    target = parse_sentinel(url)
    if target is None:
        return CeleryTarget(url, {}, False)
    auth = ""
    if target.username or target.password:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password or '', safe='')}@"
    # Celery and kombu take the database and credentials from the first address only; all carry them.
    joined = ";".join(f"sentinel://{auth}{_netloc(h, p)}/{target.db}" for h, p in target.sentinels)
    return CeleryTarget(joined, {"master_name": target.master}, True)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
