"""Cluster configuration: a frozen dataclass, units in the names, validated.

Load from a mapping (``ClusterConfig.from_dict``) or a JSON/YAML-like file;
unknown keys are an error.  ``describe()`` lists every field with its doc.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from raymq.storage.config import StoreConfig, _positive_int, config_from_dict, describe, doc
from raymq.storage.errors import ConfigError

#: How the SDK reaches the shards (``raymq.transport``).
TRANSPORTS = ("direct", "ray")

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_delay_levels(text: str) -> tuple[int, ...]:
    """``"1s 5s 1m"`` -> (1000, 5000, 60000); levels are numbered from 1."""
    levels = []
    for item in text.split():
        m = re.fullmatch(r"(\d+)(ms|s|m|h|d)", item)
        if not m:
            raise ConfigError(f"bad delay level {item!r}: use a number and one of "
                              f"{', '.join(_UNIT_MS)} (e.g. 10s)")
        levels.append(int(m.group(1)) * _UNIT_MS[m.group(2)])
    if not levels:
        raise ConfigError("delay_levels must name at least one level")
    if any(b < a for a, b in zip(levels, levels[1:])):
        raise ConfigError("delay levels must not decrease")
    return tuple(levels)


def default_data_dir() -> str:
    return os.environ.get("RAYMQ_DATA_DIR") or os.path.join(os.path.expanduser("~"), ".raymq", "data")


@dataclass(frozen=True)
class ClusterConfig:
    num_shards: int = doc("Number of BrokerShard actors (shard-0 ... shard-N-1).", 2)
    data_dir: str = doc("Directory (on each node) under which shards keep their files; "
                        "default $RAYMQ_DATA_DIR or ~/.raymq/data.", "")
    flush_mode: str = doc("'sync' (fsync, group commit, before SEND_OK) or 'async'.", "sync")
    segment_size_bytes: int = doc("Commit-log segment size of every shard.", 64 * 1024 * 1024)
    max_message_bytes: int = doc("Largest message body accepted.", 4 * 1024 * 1024)
    default_queues: int = doc("Queues of a topic created without a count (and auto-created).", 4)
    auto_create_topics: bool = doc("Create an unknown topic on first send instead of failing.",
                                   False)
    delay_levels: str = doc("Delay levels, level 1 first (RocketMQ's 18 by default).",
                            DEFAULT_DELAY_LEVELS)
    retry_first_level: int = doc("Delay level of the first redelivery after a consumer "
                                 "failure; each further failure uses the next level.", 3)
    max_reconsume: int = doc("Failures after which a message goes to the group's dead-letter "
                             "topic.", 16)
    heartbeat_interval_ms: int = doc("How often consumers and producers heartbeat.", 1000)
    session_timeout_ms: int = doc("A member silent for this long is dead: its queues are "
                                  "reassigned.", 6000)
    send_timeout_ms: int = doc("One attempt of a send waits this long for the shard.", 10_000)
    send_retries: int = doc("Attempts after the first for a retriable send failure "
                            "(exponential back-off).", 8)
    retry_backoff_ms: int = doc("First back-off between send attempts; doubles each time.", 100)
    retry_backoff_max_ms: int = doc("Longest back-off between send attempts.", 3000)
    linger_ms: int = doc("How long a producer holds a request that is not full, waiting for "
                         "more sends to join it (0: send as soon as the shard's lane is free; "
                         "while a request is in flight, sends gather anyway).", 0)
    batch_max_messages: int = doc("Most messages in one producer request to a shard.", 2000)
    producer_lanes: int = doc("Requests a producer may have in flight to one shard (queue i "
                              "always uses lane i % lanes, so queue order is kept). More lanes overlap requests "
                              "but make more, smaller ones: measure before raising it.", 1)
    transport: str = doc("How producers and consumers reach the shards: 'direct' (each shard's "
                         "socket endpoint, found through its actor; ~0.1 ms a call) or 'ray' "
                         "(a Ray actor call each, ~1 ms). A client may choose its own "
                         "(connect(transport=...)).", "direct")
    pull_batch_messages: int = doc("Most messages a consumer fetches per queue per pull.", 1000)
    pull_wait_ms: int = doc("How long a pull waits at the shard for new messages (long poll).",
                            500)
    schedule_tick_ms: int = doc("Longest wait of the delay scheduler between checks.", 100)
    shard_max_concurrency: int = doc("Concurrent calls a shard serves (threads).", 32)
    txn_timeout_ms: int = doc("A half message with no commit/rollback this long after it was "
                              "stored is checked back (per-message override: "
                              "TransactionProducer.send_in_transaction(timeout_ms=...)).", 6000)
    txn_check_interval_ms: int = doc("How often checker workers run a check-back round.", 30_000)
    txn_max_checks: int = doc("Checks of one half before it moves to the check-expired topic.",
                              15)
    txn_check_backoff_max_ms: int = doc("Longest wait between two checks of the same half "
                                        "(the wait doubles from txn_timeout_ms).", 300_000)
    txn_max_checks_per_group: int = doc("Most checks one checker sends to a producer group "
                                        "per round, over all its shards: a check storm stays "
                                        "bounded.", 1000)
    num_checkers: int = doc("CheckerWorker actors; checker k covers the shards i with "
                            "i % num_checkers == k.", 1)
    num_registries: int = doc("ProducerGroupRegistry actors; a group is served by the "
                              "registry its name hashes to.", 1)
    producer_lease_ms: int = doc("A transaction producer that has not heartbeat for this long "
                                 "is no longer live for check-backs.", 6000)

    def __post_init__(self) -> None:
        for name in ("num_shards", "default_queues", "max_reconsume", "heartbeat_interval_ms",
                     "session_timeout_ms", "send_timeout_ms", "retry_backoff_ms",
                     "retry_backoff_max_ms", "batch_max_messages", "pull_batch_messages",
                     "schedule_tick_ms", "shard_max_concurrency", "retry_first_level",
                     "txn_timeout_ms", "txn_check_interval_ms", "txn_max_checks",
                     "txn_check_backoff_max_ms", "txn_max_checks_per_group", "num_checkers",
                     "num_registries", "producer_lease_ms", "producer_lanes"):
            _positive_int(self, name)
        for name in ("send_retries", "linger_ms", "pull_wait_ms"):
            _positive_int(self, name, minimum=0)
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, not {self.transport!r}")
        if not isinstance(self.auto_create_topics, bool):
            raise ConfigError("auto_create_topics must be true or false")
        levels = parse_delay_levels(self.delay_levels)
        if self.retry_first_level > len(levels):
            raise ConfigError(f"retry_first_level {self.retry_first_level} is past the last "
                              f"delay level ({len(levels)})")
        if self.session_timeout_ms <= self.heartbeat_interval_ms:
            raise ConfigError("session_timeout_ms must be longer than heartbeat_interval_ms")
        self.store_config()  # validates the storage part

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        return parse_delay_levels(self.delay_levels)

    def resolved_data_dir(self) -> str:
        return self.data_dir or default_data_dir()

    def store_config(self) -> StoreConfig:
        return StoreConfig(flush_mode=self.flush_mode, segment_size_bytes=self.segment_size_bytes,
                           max_message_bytes=self.max_message_bytes,
                           max_frame_bytes=max(8 * 1024 * 1024,
                                               self.max_message_bytes + 128 * 1024))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "ClusterConfig":
        return config_from_dict(cls, values)

    @classmethod
    def describe(cls):
        return describe(cls)
