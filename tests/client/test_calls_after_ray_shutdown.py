"""A call through the SDK after ``ray.shutdown()`` in its process fails, naming why; it
does not start a new local Ray of its own (Ray's auto-init did, and a test harness then
could not shut its cluster down: the Kafka listener's failover scenario, issue 34)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import ray
from raymq.rpc import ActorClient
from raymq.storage.errors import RayUnreachableError

@ray.remote(num_cpus=0)
class Echo:
    def ping(self):
        return "pong"

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
echo = ActorClient(Echo.remote())
print("before", echo.call("ping", timeout_s=60), flush=True)
ray.shutdown()
try:
    echo.call("ping", timeout_s=10)
except RayUnreachableError as err:
    print("refused:", err, flush=True)
print("ray running again:", ray.is_initialized(), flush=True)
"""


def test_a_call_after_ray_shutdown_fails_and_starts_no_ray():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "before pong" in done.stdout
    assert "refused: cannot call ping: Ray no longer runs in this process" in done.stdout
    assert "ray running again: False" in done.stdout
