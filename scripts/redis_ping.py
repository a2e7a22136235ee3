"""Exit 0 if a Redis answers PING at the URL given (used by run.sh and .ci/run)."""

import sys

import redis

from fleet.redis_url import sync_client

try:
    sync_client(sys.argv[1], socket_connect_timeout=1, socket_timeout=1).ping()
except (redis.RedisError, OSError):
    sys.exit(1)
