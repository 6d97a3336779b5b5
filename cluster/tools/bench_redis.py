"""Redis as ``raymq bench txmsg``'s baseline: the outbox pattern a service would use instead
of a transactional message -- one MULTI of an HSET (the business row) and an XADD (the
message) -- on a Redis of its own with ``appendfsync always`` (every write fsynced before
it is answered, as RayMQ's sends are), through Redis's own Python client (redis-py).

Optional: it runs when ``redis-server`` is on PATH and redis-py imports; else
``unavailable()`` says why and the suite reports the RayMQ figures alone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time


def unavailable() -> str | None:
    """Why the Redis baseline cannot run here (None: it can)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (Debian: apt-get install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install 'raymq[bench]')"
    return None


class RedisOutbox:
    """A private ``redis-server`` (a Unix socket in a temporary directory, AOF with
    ``appendfsync always``, no snapshots) and outbox transactions against it."""

    def __init__(self, workdir: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="raymq-bench-redis-", dir=workdir)
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", self.socket,
             "--unixsocketperm", "700", "--dir", self.dir, "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        self.pool = redis.ConnectionPool(connection_class=redis.UnixDomainSocketConnection,
                                         path=self.socket, max_connections=64)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(connection_pool=self.pool).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("redis-server did not start (see its log in "
                                       f"{self.dir})") from None
                time.sleep(0.05)

    def outbox(self, n: int, body: bytes, threads: int = 1) -> float:
        """``threads`` callers, ``n`` outbox transactions each; the seconds it took."""
        import redis

        from raymq.tools.bench import threads_timed

        def caller(k: int) -> None:
            r = redis.Redis(connection_pool=self.pool)
            for i in range(n):
                pipe = r.pipeline(transaction=True)
                pipe.hset(f"order:{k}:{i}", mapping={"state": "paid", "total": "42"})
                pipe.xadd("outbox", {"body": body})
                pipe.execute()
        return threads_timed(caller, threads)

    def close(self) -> None:
        self.pool.disconnect()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
