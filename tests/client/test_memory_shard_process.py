"""A shard's process keeps its anonymous memory bounded: it starts with glibc's malloc
limited to 2 arenas and no per-thread caches (issue 12 E, ``raymq bench soak``).

Why: a shard runs in a Ray worker of ~66 threads (Ray's own and the data channel's).
With glibc's defaults (8 arenas per core, a thread cache each, a mmap threshold that
rises after the first large free) its RssAnon grew for as long as a soak ran, 15-23
MiB per million messages, while the Python heap stayed flat (tracemalloc, allocated
blocks and gc objects flat; the half index and producer table bounded): the growth was
free memory kept by the thread arenas (mallinfo ``fordblks`` 5 -> 13 MiB in 50 s) and
chunks held in thread caches.  Started with the tunables the soak measured ~1.2 MiB
per million messages over 96 s after its warm-up, malloc's own figures flat.

No Ray here: the deploy code is called with Ray's calls replaced, and the tunables are
tried on a child process of this one.
"""
from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

from tests.deploy_fakes import shard_actor_options


def tunables(env: dict) -> dict[str, str]:
    """``GLIBC_TUNABLES`` of an environment as {name: value}."""
    text = env.get("GLIBC_TUNABLES", "")
    return dict(item.split("=", 1) for item in text.split(":") if "=" in item)


def test_every_shard_actor_starts_with_two_malloc_arenas_no_thread_caches_and_a_fixed_mmap_threshold(
        monkeypatch):
    options = shard_actor_options(monkeypatch)
    assert len(options) == 2
    for opts in options:
        env = opts.get("runtime_env", {}).get("env_vars", {})
        assert tunables(env) == {"glibc.malloc.arena_max": "2",
                                 "glibc.malloc.tcache_count": "0",
                                 "glibc.malloc.mmap_threshold": "1048576"}, opts


_ARENAS = textwrap.dedent("""
    import ctypes, threading
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def churn():  # ctypes lets the GIL go: the threads meet in malloc at the same time
        for _ in range(20000):
            libc.free(libc.malloc(4096))
    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc.open_memstream.restype = ctypes.c_void_p
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(buf.value.decode().count("<heap nr="))
""")


def arenas_of_a_busy_process(env: dict) -> int:
    """How many malloc arenas a process makes when 8 threads allocate at once."""
    out = subprocess.run([sys.executable, "-c", _ARENAS], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc's malloc only")
def test_the_shard_tunables_bound_the_arenas_of_a_busy_process(monkeypatch):
    [opts, *_] = shard_actor_options(monkeypatch, num_shards=1)
    env = opts["runtime_env"]["env_vars"]
    plain = arenas_of_a_busy_process({"GLIBC_TUNABLES": ""})
    if plain <= 2:  # the workload must make arenas by itself, or this proves nothing
        pytest.skip(f"8 threads made only {plain} malloc arenas here (one CPU?)")
    assert arenas_of_a_busy_process(env) <= 2
