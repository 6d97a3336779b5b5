"""The storage demonstration behind ``raymq demo --storage``.

A child process appends order messages with sync flush and reports every
acknowledged batch; the demo kills it with SIGKILL mid-stream, tears the last
write as a power cut would, reopens the store and checks that every
acknowledged message is there, whole and in order.  Exit status 1 if not.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from raymq.storage import MessageStore, RecordBatch, StoreConfig

TOPIC = "orders"


def _body(b: int, i: int) -> bytes:
    return f'{{"order": "o-{b}-{i}", "amount": {(b * 7 + i) % 100 + 1}}}'.encode()


def child(directory: str) -> None:
    store = MessageStore(directory, StoreConfig(flush_mode="sync"))
    b = 0
    while True:
        n = 1 + (b * 37) % 200
        res = store.put(RecordBatch(TOPIC, b % 4, [_body(b, i) for i in range(n)],
                                    keys=[f"o-{b}-{i}" for i in range(n)]))
        print(f"ACK {b} {b % 4} {res.queue_offsets[0]} {n}", flush=True)
        b += 1


def run(data_dir: str | None = None, *, acks: int = 200, out=sys.stdout) -> int:
    directory = data_dir or tempfile.mkdtemp(prefix="raymq-storage-demo-")
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    say(f"RayMQ storage demo (the full broker demo comes with the cluster issues)\n"
        f"data directory: {directory}")
    proc = subprocess.Popen([sys.executable, "-m", "raymq.tools.storage_demo", "child", directory],
                            stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    acked = []
    for line in proc.stdout:
        acked.append(tuple(int(x) for x in line.split()[1:]))
        if len(acked) % 50 == 0:
            say(f"  writer acknowledged {len(acked)} batches "
                f"({sum(a[3] for a in acked)} messages, sync flush)")
        if len(acked) >= acks:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked += [tuple(int(x) for x in line.split()[1:]) for line in proc.stdout.read().splitlines()]
    say(f"  killed the writer with SIGKILL after {len(acked)} acknowledged batches")
    seg_dir = os.path.join(directory, "commitlog")
    last = os.path.join(seg_dir, sorted(os.listdir(seg_dir))[-1])
    with open(last, "ab") as f:
        f.write(b"RMQ1" + os.urandom(300))  # a torn write past the end
    say("  appended 304 bytes of a torn frame to the last segment")
    problems = 0
    with MessageStore(directory, StoreConfig(), background=False) as store:
        for b, qid, start, n in acked:
            got = store.read_queue(TOPIC, qid, start, n)
            if [m.body for m in got] != [_body(b, i) for i in range(n)]:
                problems += 1
                say(f"  LOST: batch {b} (queue {qid}, offsets {start}..{start + n - 1})")
        total = sum(store.max_queue_offset(TOPIC, q) for q in range(4))
    ok = problems == 0
    say(f"report: {len(acked)} acknowledged batches, {sum(a[3] for a in acked)} acknowledged "
        f"messages, {total} messages stored after recovery, {problems} batches lost -> "
        f"{'CONSISTENT' if ok else 'INCONSISTENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2])
    else:
        raise SystemExit(run())
