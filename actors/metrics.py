"""What a broker component records metrics into (``NullMetrics`` records nothing), and
the gauges a shard reports every few seconds (``shard_gauges``, ``replication_gauges``).

The deployed actors are given ``raymq.metrics.RayMetrics`` (Ray's Prometheus endpoint).
"""
from __future__ import annotations


class NullMetrics:
    def inc(self, name: str, value: float = 1.0, **tags) -> None:
        pass

    def set(self, name: str, value: float, **tags) -> None:
        pass

    def observe(self, name: str, value: float, **tags) -> None:
        pass

    def flush(self) -> None:
        pass


def shard_gauges(shard) -> list[tuple[str, float, dict]]:
    """A ``BrokerShard``'s gauges as (name, value, tags), read from its parts without a
    call out of the process: messages stored, the bytes its files take on disk, each
    group's lag, half messages pending
    and check-expired, open Kafka-style transactions, timers scheduled and due within
    the minute, how late timer delivery runs, and retention's (the log's start, what was
    deleted, the disk, messages aged out per topic).  Tags stay bounded (a group or topic
    name at most: no per-queue series)."""
    from raymq.storage.fileutil import disk_usage
    store = shard.store
    out = [("messages_stored", float(sum(store.max_queue_offset(t, q)
                                         for t, q in store.queues())), {}),
           ("disk_bytes", float(disk_usage(shard.directory)), {})]
    for group, lags in shard.offsets.lag().items():
        out.append(("consumer_lag", float(sum(lags.values())), {"group": group}))
    halves = shard.transaction_status()
    out.append(("halves_pending", float(halves.get("pending_halves", 0)), {}))
    out.append(("halves_expired", float(halves.get("expired_halves", 0)), {}))
    out.append(("kafka_transactions_open", float(len(shard.ktx_status())), {}))
    timers = shard.timers.status()
    out.append(("timers_scheduled", float(timers.get("scheduled", 0)), {}))
    out.append(("timers_due_next_minute", float(timers.get("next_minute", 0)), {}))
    out.append(("timer_delivery_lag_ms", float(timers.get("lag_ms", 0)), {}))
    ret = shard.janitor.status()  # retention: what went, the disk, each topic's aged-out count
    out += [("log_start_offset", float(ret["log_start_phys"]), {}),
            ("segments_deleted", float(ret["deleted_segments"]), {}),
            ("bytes_deleted", float(ret["deleted_bytes"]), {}),
            ("disk_free_bytes", float(ret["disk_free_bytes"]), {}),
            ("disk_used_ratio", float(ret["disk_used_ratio"]), {}),
            ("disk_full", 1.0 if ret["disk_full"] else 0.0, {})]
    aged: dict[str, int] = {}
    for key, start in ret["log_starts"].items():
        topic = key.rsplit("/", 1)[0]
        aged[topic] = aged.get(topic, 0) + start
    out += [("messages_aged_out", float(n), {"topic": t}) for t, n in aged.items()]
    return out


def replication_gauges(status: dict) -> list[tuple[str, float, dict]]:
    """A replica leader's ``status()`` as gauges: each follower's lag in bytes and the
    in-sync count."""
    out = [("replication_lag_bytes", float(lag), {"follower": name})
           for name, lag in status.get("lag_bytes", {}).items()]
    if "in_sync" in status:
        out.append(("replicas_in_sync", float(len(status["in_sync"])), {}))
    return out
