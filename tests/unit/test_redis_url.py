"""The REDIS_URL owner: which URLs are accepted, and what a Sentinel URL becomes for Celery."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool

from api.settings import ApiSettings
from fleet.celeryconf import SHARED_CLIENT_SENTINEL_TRANSPORT, SHARED_CLIENT_TRANSPORT, celery_config
from fleet.redis_url import SentinelUrl, async_client, celery_target, check, parse_sentinel, redact


def test_a_sentinel_url_names_every_sentinel_the_master_and_the_database() -> None:
    parsed = parse_sentinel("sentinel://:p%40ss@s1:26380,s2,[::1]:26381/2?master=mymaster")
    assert parsed == SentinelUrl((("s1", 26380), ("s2", 26379), ("::1", 26381)), "mymaster", 2, None, "p@ss")
    assert parse_sentinel("redis://localhost:6379/0") is None


@pytest.mark.parametrize("url", ["sentinel://s1:26379/0", "sentinel:///0?master=m", "sentinel://s1:x/0?master=m",
                                 "sentinel://s1/db?master=m", "http://s1", "s1:6379"])
def test_malformed_urls_are_refused_with_the_setting_named(url: str) -> None:
    with pytest.raises(ValueError, match="REDIS_URL"):
        check(url, "REDIS_URL")


def test_settings_accept_a_sentinel_url_and_refuse_one_without_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "sentinel://s1:26379,s2:26379/0?master=m")
    assert ApiSettings().redis_url.startswith("sentinel://")
    monkeypatch.setenv("REDIS_URL", "sentinel://s1:26379/0")
    with pytest.raises(ValueError, match="master"):
        ApiSettings()


def test_celery_gets_its_own_spelling_and_the_master_name_for_broker_and_backend() -> None:
    target = celery_target("sentinel://u:secret@s1:26380,s2:26381/3?master=mymaster")
    assert target.sentinel
    assert target.url == "sentinel://u:secret@s1:26380/3;sentinel://u:secret@s2:26381/3"
    conf = celery_config(visibility_timeout=30, result_expires=60,
                         redis_url="sentinel://s1:26380/3?master=mymaster")
    assert conf["broker_transport_options"]["master_name"] == "mymaster"
    assert conf["result_backend_transport_options"]["master_name"] == "mymaster"
    assert conf["broker_transport"] == SHARED_CLIENT_SENTINEL_TRANSPORT
    plain = celery_config(visibility_timeout=30, result_expires=60, redis_url="redis://h:6379/0")
    assert plain["broker_transport"] == SHARED_CLIENT_TRANSPORT
    assert "master_name" not in plain["broker_transport_options"]
    assert celery_target("rediss://h:6379/0").url == "rediss://h:6379/0?ssl_cert_reqs=required"


def test_messages_never_show_the_password() -> None:
    assert redact("sentinel://:secret@s1:26379/0?master=m") == "sentinel://:***@s1:26379/0?master=m"
    with pytest.raises(ValueError) as caught:
        check("sentinel://:secret@s1:26379/0", "REDIS_URL")
    assert "secret" not in str(caught.value)


def test_the_apis_sentinel_pool_still_blocks_at_its_size() -> None:
    """Over Sentinel the API keeps its bounded pool that waits for a free connection (not one that fails)."""
    client = async_client("sentinel://:pw@s1:26379,s2/3?master=m", max_connections=7, pool_timeout=0.7,
                          socket_timeout=1, socket_connect_timeout=1)
    pool = client.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool) and isinstance(pool, AsyncSentinelConnectionPool)
    assert (pool.max_connections, pool.timeout, pool.service_name) == (7, 0.7, "m")
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "pw"
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert sentinel["password"] is None and sentinel["socket_timeout"] == 1  # sentinels: no auth, same timeouts


def test_a_unix_socket_url_is_spelled_as_kombu_and_celerys_backend_read_it() -> None:
    """kombu knows no `unix://` transport (a worker on one died at start: "No such transport: unix"):
    the broker gets `redis+socket://`, the backend class the part after `redis+`, the database as
    `virtual_host`, other parameters kept."""
    target = celery_target("unix:///run/redis/redis.sock?db=3&password=pw")
    assert target.url == "redis+socket:///run/redis/redis.sock?virtual_host=3&password=pw"
    assert target.backend_url == "socket:///run/redis/redis.sock?virtual_host=3&password=pw"
    assert celery_target("unix:///r.sock").url == "redis+socket:///r.sock?virtual_host=0"
    assert celery_target("redis://h:6379/0").backend_url == "redis://h:6379/0"


def test_a_tls_url_verifies_the_certificate_unless_it_says_otherwise() -> None:
    """Celery's backend refuses `rediss://` without `ssl_cert_reqs` (a worker on one failed at its first
    result) and kombu's broker then skips verification: the default is redis-py's, `required`."""
    assert celery_target("rediss://:pw@h:6379/0").url == "rediss://:pw@h:6379/0?ssl_cert_reqs=required"
    assert celery_target("rediss://h/0?ssl_ca_certs=/ca.pem").url == "rediss://h/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"
    assert celery_target("rediss://h/0?ssl_cert_reqs=none").url == "rediss://h/0?ssl_cert_reqs=none"
