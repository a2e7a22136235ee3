"""Exit 0 if a Redis answers PING at the URL given (used by run.sh and .ci/run)."""

import sys

import redis

try:
    redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1, socket_timeout=1).ping()
except (redis.RedisError, OSError):
    sys.exit(1)
