"""toxfleet's HTTP tier: validates input, enqueues scoring jobs by task name, answers at once.

It never imports torch, transformers, detoxify or `worker` (a test enforces it): the only thing it
shares with the workers is `toxfleet.contract`. The ASGI app is `api.main:app`, served with
`UVICORN_OPTIONS`.
"""

UVICORN_OPTIONS = ("--loop", "asyncio")
"""uvicorn options of every launch of the API: scripts/run.sh, Dockerfile.api, the ECS task, the tests'
and the benchmark's servers (tests/deploy checks the static ones). The stdlib event loop, not uvloop:
libuv accepts one connection per loop iteration (libuv#3696), so a saturated API left new connections
in the kernel's accept queue for seconds, its fast 429s included; the stdlib loop accepts every waiting
connection at once, at the same CPU per job (`bench.cpu_per_job`, variant `asyncio-httptools`)."""
