"""What the web console shows (``raymq console``): one function per page, each returning
the JSON the page is drawn from, over the SDK's ``mq.admin`` calls -- the same calls the
command line makes -- and the console's own history of samples (``History``) for its
charts.  The shaping of that data (rates, lags, histograms, traces) is pure and tested
without Ray; ``Pages`` only gathers.
"""
from __future__ import annotations

import collections
import threading
import time

from raymq.replica_view import electable_line, not_electable
from raymq.storage.errors import InvalidMessageError

#: samples the charts keep: at one per ``SAMPLE_S`` seconds, the last ten minutes
HISTORY_SAMPLES = 120
SAMPLE_S = 5.0
#: timers listed on the timers page (soonest first; the histogram counts every one)
TIMERS_LISTED = 200
#: dead letters listed per shard on a group's page
DEAD_LETTERS_LISTED = 100
#: a body preview's length in bytes
PREVIEW_BYTES = 512


def is_system_topic(topic: str) -> bool:
    """RayMQ's own topics (retries, dead letters, half messages, schedules...)."""
    return topic.startswith(("%", "RMQ_SYS_", "rmq_sys_", "__"))


def counters_of(status: dict) -> dict[str, float]:
    """Cumulative counters from one ``admin.status()``: messages stored in user topics
    (``in``, and ``in:shard-N``, ``in:topic:T``) and consumed by groups (``out``, likewise);
    and gauges: each group's lag (``lag:G``)."""
    out: dict[str, float] = collections.defaultdict(float)
    for s in status["shards"]:
        info = s["info"]
        if "error" in info:
            continue
        shard = f"shard-{s['shard']}"
        for key, depth in info["queues"].items():
            topic = key.rsplit("/", 1)[0]
            if is_system_topic(topic):
                continue
            for name in ("in", f"in:{shard}", f"in:topic:{topic}"):
                out[name] += depth
        for group, lags in info.get("lag", {}).items():
            for key, lag in lags.items():
                topic = key.rsplit("/", 1)[0]
                if is_system_topic(topic) or key not in info["queues"]:
                    continue
                consumed = info["queues"][key] - lag
                for name in ("out", f"out:{shard}", f"out:topic:{topic}"):
                    out[name] += consumed
                out[f"lag:{group}"] += lag
    return dict(out)


class History:
    """The last ``keep`` samples of ``counters_of``: per-second rates of the cumulative
    ones and the gauges as they were, for the charts.  Bounded: ``keep`` samples of a
    bounded set of names."""

    def __init__(self, keep: int = HISTORY_SAMPLES):
        self._samples: collections.deque = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, t_ms: int, counters: dict[str, float]) -> None:
        with self._lock:
            self._samples.append((t_ms, dict(counters)))

    def series(self, names: list[str]) -> dict:
        """``{"t": [epoch s], name: [value]}``: a rate per second for ``in``/``out``
        names (between a sample and the one before it; a counter going back -- a shard
        restarted -- counts as 0), the value itself for gauges (``lag:``)."""
        with self._lock:
            samples = list(self._samples)
        out: dict = {"t": [t / 1000 for t, _c in samples[1:]]}
        for name in names:
            values = []
            for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
                if name.startswith("lag:"):
                    values.append(c1.get(name, 0.0))
                else:
                    dt = max(1e-3, (t1 - t0) / 1000)
                    values.append(round(max(0.0, c1.get(name, 0.0) - c0.get(name, 0.0)) / dt, 2))
            out[name] = values
        return out

    def last_rate(self, name: str) -> float:
        """The newest per-second rate of ``name`` (0 before two samples)."""
        values = self.series([name])[name]
        return values[-1] if values else 0.0


def timer_histogram(status: dict) -> list[dict]:
    """Scheduled timers of every shard by when they are due: ``[{"due": label, "count"}]``."""
    buckets = {"next minute": "next_minute", "next hour": "next_hour",
               "next day": "next_day", "later": "later"}
    counts = dict.fromkeys(buckets, 0)
    for s in status["shards"]:
        timers = s["info"].get("timers") if "error" not in s["info"] else None
        for label, key in buckets.items():
            counts[label] += int((timers or {}).get(key, 0))
    return [{"due": label, "count": n} for label, n in counts.items()]


def preview(body: bytes) -> dict:
    """A body as text when it decodes as UTF-8, else as hex: ``{"kind", "text", "bytes"}``."""
    head = body[:PREVIEW_BYTES]
    try:
        text, kind = head.decode("utf-8"), "text"
    except UnicodeDecodeError:
        text, kind = head.hex(" "), "hex"
    return {"kind": kind, "text": text, "bytes": len(body),
            "truncated": len(body) > PREVIEW_BYTES}


def trace(msg, group_offsets: dict[str, int], dead_letters: dict[str, dict]) -> list[dict]:
    """A message's story: sent (born), stored, then per consumer group of its queue
    delivered (the group's committed offset is past it) or waiting, its retries, and a
    dead letter made of it.  ``group_offsets``: group -> committed offset of the message's
    queue; ``dead_letters``: group -> the dead letter of this message there."""
    steps = [{"step": "sent", "at_ms": msg.born_ms, "detail": "by its producer"},
             {"step": "stored", "at_ms": msg.store_ms,
              "detail": f"{msg.topic}/{msg.queue_id}@{msg.queue_offset} on shard-{msg.shard}"}]
    for group, committed in sorted(group_offsets.items()):
        done = committed > msg.queue_offset >= 0
        steps.append({"step": "delivered" if done else "not consumed yet", "group": group,
                      "detail": f"group {group} committed offset {committed}"})
    if msg.reconsume_count:
        steps.append({"step": "retried", "detail": f"{msg.reconsume_count} redeliveries"})
    for group, letter in sorted(dead_letters.items()):
        steps.append({"step": "dead letter", "group": group, "at_ms": letter["store_ms"],
                      "detail": f"{letter['id']}: {letter['reason']}"})
    return steps


def replication_of(status: dict) -> dict:
    """The overview's replicated groups from one ``admin.status()``: ``replicas`` (the
    shards') and ``coordinator_replicas`` (the transaction coordinators'), each group as
    ``admin.replicas()`` gives it -- who could be elected now (``electable``, and
    ``candidacy`` per replica) -- plus ``not_electable``: the replicas that could not
    lead now, each with why, and ``electable_line``: both in one line."""
    return {key: [dict(g, not_electable=not_electable(g), electable_line=electable_line(g))
                  for g in status.get(key, [])]
            for key in ("replicas", "coordinator_replicas")}


def message_doc(msg) -> dict:
    return {"id": msg.msg_id, "stored_id": msg.stored_id, "topic": msg.topic,
            "queue_id": msg.queue_id, "queue_offset": msg.queue_offset, "shard": msg.shard,
            "key": msg.key, "tags": msg.tags, "properties": dict(msg.properties),
            "reconsume_count": msg.reconsume_count, "born_ms": msg.born_ms,
            "store_ms": msg.store_ms, "body": preview(msg.body)}


def check_id(text: str, what: str) -> str:
    if not isinstance(text, str) or not text or len(text) > 512:
        raise InvalidMessageError(f"{what} must be a non-empty string of at most 512 "
                                  f"characters, got {text!r}")
    return text


class Pages:
    """Each page's JSON, gathered through ``mq.admin`` (and ``mq``'s own calls); a sampler
    thread adds a ``History`` sample every ``sample_s`` seconds."""

    def __init__(self, mq, *, sample_s: float = SAMPLE_S, history: History | None = None):
        self.mq = mq
        self.history = history or History()
        self.sample_s = sample_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True,
                                        name="raymq-console-sampler")

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> dict:
        status = self.mq.admin.status()
        self.history.add(int(time.time() * 1000), counters_of(status))
        return status

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.sample_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 -- a cluster briefly unreachable: next time
                pass

    # ------------------------------------------------------------------ pages
    def overview(self) -> dict:
        from raymq.tools.console_cluster import actors_alive, ray_nodes
        status = self.mq.admin.status()
        shards = []
        for s in status["shards"]:
            info, name = s["info"], f"shard-{s['shard']}"
            shards.append({"shard": s["shard"], "node": s["node"], "alive": "error" not in info,
                           "error": info.get("error"), "log_bytes": info.get("log_bytes", 0),
                           "disk_bytes": s.get("disk_bytes"),
                           "oldest_held_by": info.get("retention", {}).get("oldest_held_by", ""),
                           "oldest_held_bytes": info.get("retention", {}).get(
                               "oldest_held_bytes", 0),
                           "in_per_s": self.history.last_rate(f"in:{name}"),
                           "out_per_s": self.history.last_rate(f"out:{name}")})
        return {"shards": shards, **replication_of(status),
                "actors": actors_alive(self.mq), "nodes": ray_nodes(),
                "transport": status["transport"],
                "throughput": self.history.series(["in", "out"])}

    def topics(self) -> dict:
        status = self.mq.admin.status()
        def entry(name: str, t: dict | None = None) -> dict:
            t = t or {}
            return {"queues": [], "system": is_system_topic(name),
                    "routes": list(t.get("routes", ())),
                    "retention_ms": t.get("retention_ms"),
                    "retention_bytes": t.get("retention_bytes")}
        topics = {name: entry(name, t) for name, t in sorted(status["topics"].items())}
        for s in status["shards"]:
            info = s["info"]
            starts = info.get("retention", {}).get("log_starts", {})
            for key, depth in info.get("queues", {}).items():
                topic, qid = key.rsplit("/", 1)
                lag = {g: lags[key] for g, lags in info.get("lag", {}).items() if key in lags}
                if topic not in topics:  # (a queue the shard serves of a topic not listed)
                    topics[topic] = entry(topic)
                topics[topic]["queues"].append(
                    {"queue": int(qid), "shard": s["shard"], "min_offset": starts.get(key, 0),
                     "max_offset": depth, "lag": lag})
        for t in topics.values():
            t["queues"].sort(key=lambda q: q["queue"])
        user = [n for n, t in topics.items() if not t["system"]]
        return {"topics": topics,
                "throughput": self.history.series([f"in:topic:{n}" for n in user[:20]])}

    def message(self, msg_id: str | None = None, topic: str | None = None,
                key: str | None = None) -> dict:
        if msg_id:
            found = self.mq.admin.find(check_id(msg_id, "a message id"))
        elif topic and key:
            found = self.mq.admin.find(topic=check_id(topic, "topic"),
                                       key=check_id(key, "key"))
        else:
            raise InvalidMessageError("look a message up by id, or by topic and key")
        return {"messages": [dict(message_doc(m), trace=self._trace(m)) for m in found[:50]],
                "found": len(found)}

    def _trace(self, msg) -> list[dict]:
        queue = (msg.topic, msg.queue_id)
        groups = self.mq.control.call("groups", timeout_s=30)
        offsets = {}
        for group in groups:
            got = self.mq.shard(msg.shard).call("get_offsets", group, [queue], timeout_s=30)
            if got.get(queue, -1) >= 0:
                offsets[group] = got[queue]
        letters = {}
        for group in groups:
            for d in self.mq.admin.dlq_list(group, DEAD_LETTERS_LISTED):
                if d.msg_id == msg.msg_id:  # (a dead letter keeps the id it was sent with)
                    letters[group] = {"id": d.stored_id, "store_ms": d.store_ms,
                                      "reason": d.properties.get("DLQ_REASON", "")}
        return trace(msg, offsets, letters)

    def halves(self) -> dict:
        now = int(time.time() * 1000)
        return {"pending": self.mq.admin.half_list(), "expired": self.mq.admin.half_list(
            expired=True), "now_ms": now}

    def transactions(self) -> dict:
        return {"transactions": self.mq.admin.tx_list(), "hanging": self.mq.admin.tx_hanging()}

    def transaction(self, transactional_id: str) -> dict:
        return self.mq.admin.tx_describe(check_id(transactional_id, "a transactional id"))

    def timers(self) -> dict:
        status = self.mq.admin.status()
        now = int(time.time() * 1000)
        lateness = [{"shard": s["shard"], "lag_ms": s["info"]["timers"].get("lag_ms", 0),
                     "max_lateness_ms": s["info"]["timers"].get("max_lateness_ms", 0)}
                    for s in status["shards"] if s["info"].get("timers")]
        soonest = self.mq.admin.timer_list(now + 365 * 86_400_000, TIMERS_LISTED)
        return {"histogram": timer_histogram(status), "lateness": lateness,
                "soonest": soonest, "now_ms": now}

    def groups(self) -> dict:
        status = self.mq.admin.status()
        lag: dict[str, dict[str, int]] = {}
        for s in status["shards"]:
            for group, lags in s["info"].get("lag", {}).items():
                lag.setdefault(group, {}).update(lags)
        groups = {}
        for name in sorted(set(status["groups"]) | set(lag)):
            members = status["groups"].get(name, {}).get("members", {})
            groups[name] = {"members": members,
                            "lag": sum(lag.get(name, {}).values()),
                            "lag_by_queue": lag.get(name, {})}
        return {"groups": groups,
                "lag_history": self.history.series([f"lag:{g}" for g in list(groups)[:20]])}

    def dead_letters(self, group: str) -> dict:
        letters = self.mq.admin.dlq_list(check_id(group, "a group"), DEAD_LETTERS_LISTED)
        return {"group": group, "dead_letters": [
            dict(message_doc(m), reason=m.properties.get("DLQ_REASON", "")) for m in letters]}
