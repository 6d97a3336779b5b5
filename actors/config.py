"""The cluster's configuration: ``ClusterConfig``, every setting with its type, default and doc,
and the rules that make a configuration valid (the delay-level syntax, the data directory default).

``ClusterConfig`` is a frozen pydantic model: each field carries its constraint
(``ge``, a ``Literal``, strict types: no bool for an int, no string for a bool)
and its doc (``description``); the rules across fields are model validators.
Load from a mapping (``ClusterConfig.from_dict``) or keywords; unknown keys are
an error.  Every refusal is one ``ConfigError`` line naming the field.
``describe()`` lists every field with its default and doc (``raymq config
--describe``).  The config is pickled across Ray and handed to actors as
``to_dict()``.
"""
from __future__ import annotations

import os
import re
from typing import Any, Literal, Mapping, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt,
                      StrictStr, ValidationError, field_validator, model_validator)

from raymq.storage.config import StoreConfig
from raymq.storage.errors import ConfigError

Transport = Literal["direct", "ray"]
FlushMode = Literal["sync", "async"]

#: How the SDK reaches the shards (``raymq.transport``).
TRANSPORTS: tuple[str, ...] = get_args(Transport)

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

#: The rules across fields (checked by ``ClusterConfig._check_across_fields``), for help texts.
RULES = (
    "delay_levels: numbers with a unit (ms, s, m, h, d), at least one, not decreasing",
    "retry_first_level <= the number of delay levels",
    "session_timeout_ms > heartbeat_interval_ms",
    "min_insync_replicas <= replication_factor",
    "disk_clean_ratio <= disk_full_ratio",
    "segment_size_bytes holds one largest frame: max(8 MiB, max_message_bytes + 128 KiB) + 64",
)


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
    return (os.environ.get("RAYMQ_DATA_DIR")
            or os.path.join(os.path.expanduser("~"), ".raymq", "data"))


class ClusterConfig(BaseModel):
    """The whole cluster's settings; immutable, hashable, picklable, compared by value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_shards: StrictInt = Field(
        2, ge=1, description="Number of BrokerShard actors (shard-0 ... shard-N-1).")
    data_dir: StrictStr = Field(
        "", description="Directory (on each node) under which shards keep their files; "
                        "default $RAYMQ_DATA_DIR or ~/.raymq/data. A '{node}' in it is the "
                        "Ray node id of each replica (nodes sharing one disk).")
    flush_mode: FlushMode = Field(
        "sync", description="'sync' (fsync, group commit, before SEND_OK) or 'async'.")
    segment_size_bytes: StrictInt = Field(
        64 * 1024 * 1024, ge=4096, description="Commit-log segment size of every shard.")
    max_message_bytes: StrictInt = Field(
        4 * 1024 * 1024, ge=1, description="Largest message body accepted.")
    default_queues: StrictInt = Field(
        4, ge=1, description="Queues of a topic created without a count (and auto-created).")
    auto_create_topics: StrictBool = Field(
        False, description="Create an unknown topic on first send instead of failing.")
    delay_levels: StrictStr = Field(
        DEFAULT_DELAY_LEVELS,
        description="Delay levels, level 1 first: numbers with a unit (ms, s, m, h, d), not "
                    "decreasing (RocketMQ's 18 by default).")
    retry_first_level: StrictInt = Field(
        3, ge=1, description="Delay level of the first redelivery after a consumer failure; "
                             "each further failure uses the next level.")
    max_reconsume: StrictInt = Field(
        16, ge=1, description="Failures after which a message goes to the group's dead-letter "
                              "topic.")
    heartbeat_interval_ms: StrictInt = Field(
        1000, ge=1, description="How often consumers and producers heartbeat.")
    session_timeout_ms: StrictInt = Field(
        6000, ge=1, description="A member silent for this long is dead: its queues are "
                                "reassigned.")
    send_timeout_ms: StrictInt = Field(
        10_000, ge=1, description="One attempt of a send waits this long for the shard.")
    send_retries: StrictInt = Field(
        8, ge=0, description="Attempts after the first for a retriable send failure "
                             "(exponential back-off).")
    retry_backoff_ms: StrictInt = Field(
        100, ge=1, description="First back-off between send attempts; doubles each time.")
    retry_backoff_max_ms: StrictInt = Field(
        3000, ge=1, description="Longest back-off between send attempts.")
    linger_ms: StrictInt = Field(
        0, ge=0, description="How long a producer holds a request that is not full, waiting "
                             "for more sends to join it (0: send as soon as the shard's lane is "
                             "free; while a request is in flight, sends gather anyway).")
    batch_max_messages: StrictInt = Field(
        2000, ge=1, description="Most messages in one producer request to a shard.")
    producer_lanes: StrictInt = Field(
        1, ge=1, description="Requests a producer may have in flight to one shard (queue i "
                             "always uses lane i % lanes, so queue order is kept). More lanes "
                             "overlap requests but make more, smaller ones: measure before "
                             "raising it.")
    transport: Transport = Field(
        "direct", description="How producers and consumers reach the shards: 'direct' (each "
                              "shard's data channel, raymq.actors.channel, found through its "
                              "actor; ~0.1 ms a call) or 'ray' (a Ray actor call each, ~1 ms). "
                              "A client may choose its own (connect(transport=...)).")
    pull_batch_messages: StrictInt = Field(
        1000, ge=1, description="Most messages a consumer fetches per queue per pull.")
    pull_wait_ms: StrictInt = Field(
        500, ge=0, description="How long a pull waits at the shard for new messages "
                               "(long poll).")
    schedule_tick_ms: StrictInt = Field(
        100, ge=1, description="Longest wait of the delay scheduler between checks.")
    max_delay_ms: StrictInt = Field(
        40 * 24 * 3600 * 1000, ge=1, description="Longest deliver_at_ms / deliver_after_ms "
        "schedule (40 days); past it a send fails with INVALID_MESSAGE.")
    timer_bucket_ms: StrictInt = Field(
        60_000, ge=1000, description="Due-time span of one timer-wheel bucket file: a shard "
        "holds one bucket of scheduled messages in memory at a time.")
    retention_ms: StrictInt = Field(
        3 * 24 * 3600 * 1000, ge=1, description="How long a topic's messages are kept (3 "
        "days; a topic may set its own): a commit-log segment is deleted once every message "
        "in it is older than its topic's retention, and each queue's log start moves past it.")
    retention_bytes: StrictInt = Field(
        -1, ge=-1, description="Most bytes a queue keeps (-1: no limit; a topic may set its "
        "own): older segments go once the queue holds this much after them.")
    retention_check_ms: StrictInt = Field(
        10_000, ge=100, description="How often a shard looks for segments to delete and "
        "measures its disk.")
    disk_clean_ratio: float = Field(
        0.75, gt=0, le=1, description="Above this used fraction of the data directory's "
        "filesystem the oldest segments are deleted even before their retention (never what "
        "a pending half message, timer or open transaction still needs).")
    disk_full_ratio: float = Field(
        0.90, gt=0, le=1, description="Above this used fraction writes are refused with a "
        "retriable DISK_FULL (reads, consumption, offset commits and the ends of prepared "
        "transactions go on); they resume by themselves when space comes back.")
    max_open_queue_files: StrictInt = Field(
        1024, ge=1, description="Most consume-queue files a shard keeps open (least recently "
        "used closed and reopened on demand; at most half of ulimit -n).")
    max_open_segments: StrictInt = Field(
        64, ge=1, description="Most sealed commit-log segments a shard keeps open.")
    max_topics: StrictInt = Field(
        10_000, ge=1, description="Most user topics the cluster holds: creating one more "
        "fails with QUOTA_EXCEEDED.")
    max_groups: StrictInt = Field(
        10_000, ge=1, description="Most consumer groups: a new group's first heartbeat or "
        "offset commit beyond it fails with QUOTA_EXCEEDED.")
    num_coordinators: StrictInt = Field(
        1, ge=1, le=255, description="Kafka-style transaction coordinators (transactional "
        "ids hash over them).")
    kafka_txn_timeout_ms: StrictInt = Field(
        60_000, ge=1, description="A Kafka-style transaction open longer is aborted by its "
        "coordinator (a producer may ask for its own).")
    max_txn_timeout_ms: StrictInt = Field(
        900_000, ge=1, description="The longest transaction timeout a Kafka-style producer "
        "may ask for (Kafka's transaction.max.timeout.ms): a longer one is refused.")
    transactional_id_expiration_ms: StrictInt = Field(
        7 * 24 * 3600 * 1000, ge=1, description="A transactional id with no transaction "
        "open and no call this long is forgotten by its coordinator (Kafka's "
        "transactional.id.expiration.ms); its producer starts again with a new producer id.")
    state_log_compact_records: StrictInt = Field(
        10_000, ge=1, description="A coordinator's transaction log and a shard's "
        "Kafka-style index are folded into a snapshot of their live state once this many "
        "records follow the last one: a restart reads the snapshot and this tail at most.")
    kafka_txn_check_interval_ms: StrictInt = Field(
        1000, ge=1, description="How often a coordinator looks for transactions past their "
        "timeout.")
    shard_max_concurrency: StrictInt = Field(
        32, ge=1, description="Concurrent calls a shard serves (threads).")
    txn_timeout_ms: StrictInt = Field(
        6000, ge=1, description="A half message with no commit/rollback this long after it "
                                "was stored is checked back (per-message override: "
                                "TransactionProducer.send_in_transaction(timeout_ms=...)).")
    txn_check_interval_ms: StrictInt = Field(
        30_000, ge=1, description="How often checker workers run a check-back round.")
    txn_max_checks: StrictInt = Field(
        15, ge=1, description="Checks of one half before it moves to the check-expired topic.")
    txn_check_backoff_max_ms: StrictInt = Field(
        300_000, ge=1, description="Longest wait between two checks of the same half (the "
                                   "wait doubles from txn_timeout_ms).")
    txn_max_checks_per_group: StrictInt = Field(
        1000, ge=1, description="Most checks one checker sends to a producer group per round, "
                                "over all its shards: a check storm stays bounded.")
    num_checkers: StrictInt = Field(
        1, ge=1, description="CheckerWorker actors; checker k covers the shards i with "
                             "i % num_checkers == k.")
    num_registries: StrictInt = Field(
        1, ge=1, description="ProducerGroupRegistry actors; a group is served by the registry "
                             "its name hashes to.")
    producer_lease_ms: StrictInt = Field(
        6000, ge=1, description="A transaction producer that has not heartbeat for this long "
                                "is no longer live for check-backs.")
    # --- a shard's data channel (raymq.actors.channel): what one peer can hold
    channel_max_connections: StrictInt = Field(
        1024, ge=1, description="Most authenticated connections a shard's data channel serves "
                                "(a thread and a descriptor each); more are closed after their "
                                "handshake and logged (the client falls back to Ray calls).")
    channel_max_connections_per_peer: StrictInt = Field(
        256, ge=1, description="Most authenticated data-channel connections of a shard from "
                               "one peer address (a client process opens up to one per "
                               "concurrent call to the shard).")
    channel_max_handshakes: StrictInt = Field(
        128, ge=1, description="Most data-channel connections of a shard in their handshake "
                               "(not authenticated yet), a budget apart from the served ones: "
                               "peers without the key cannot take an authenticated peer's "
                               "place; more are closed at once.")
    channel_max_handshakes_per_peer: StrictInt = Field(
        16, ge=1, description="Most data-channel connections in their handshake from one peer "
                              "address.")
    channel_handshake_timeout_ms: StrictInt = Field(
        10_000, ge=1, description="A data-channel connection must finish its whole handshake "
                                  "(TLS, key challenge, versions) within this time, or it is "
                                  "closed.")
    channel_idle_timeout_ms: StrictInt = Field(
        300_000, ge=1, description="A data-channel connection with no request (or a reply "
                                   "its client does not read) for this long is closed; the "
                                   "client reconnects.")
    channel_reserve_fds: StrictInt = Field(
        64, ge=0, description="Descriptors a shard keeps free for its store: the data "
                              "channel refuses connections when fewer are left before the "
                              "process limit (RLIMIT_NOFILE).")
    channel_max_request_bytes: StrictInt = Field(
        64 * 1024 * 1024, ge=65_536,
        description="Largest request frame a shard's data channel reads; a bigger one is "
                    "refused from its header (CHANNEL_REFUSED). Clients send a request "
                    "larger than this through a Ray call instead, so no send fails for it.")
    channel_pull_max_messages: StrictInt = Field(
        100_000, ge=1, description="Most messages one pull over the data channel reads, over "
                                   "all its queues: each queue's count is clamped to its share "
                                   "(a pull naming more queues is refused).")
    channel_pull_max_wait_ms: StrictInt = Field(
        30_000, ge=0, description="Longest long-poll wait of a pull over the data channel; a "
                                  "longer wait is clamped.")
    replication_factor: StrictInt = Field(
        1, ge=1, le=7, description="Replicas of each shard, each on its own Ray node "
                                   "(a STRICT_SPREAD placement group); 1: no replication.")
    kafka_port: StrictInt = Field(
        0, ge=0, le=65535, description="Port of a Kafka-protocol listener on each node RayMQ "
                                       "runs on (a Ray actor per node; clients give "
                                       "bootstrap.servers=NODE:PORT); 0: none.")
    min_insync_replicas: StrictInt = Field(
        0, ge=0, description="Replicas that must hold a write before SEND_OK (the leader "
                             "among them); 0: 2 when replication_factor >= 2, else 1. Fewer "
                             "in sync: sends fail with NotEnoughReplicasError.")
    replica_lag_max_ms: StrictInt = Field(
        10_000, ge=100, description="A follower not caught up with its leader for this long "
                                    "leaves the in-sync set (it rejoins once caught up).")
    replica_timer_ship_ms: StrictInt = Field(
        60_000, ge=0, description="Least time between two copies of a shard's timer wheel "
        "shipped by its leader to a follower (it changes with every bucket); a new leader "
        "indexes again the timer messages written after the copy it holds.")
    replica_lease_ms: StrictInt = Field(
        1_500, ge=200, description="A replica that has not reached the controller for this "
                                   "long counts as dead: a dead leader is replaced by an "
                                   "in-sync replica, a dead follower leaves the in-sync set.")

    #: ``delay_levels`` parsed once, when the config is validated (pickled with it)
    _delay_levels_ms: tuple[int, ...] = PrivateAttr(default=())

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise _config_error(type(self), err) from None

    @field_validator("data_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        """A ``pathlib.Path`` is a directory too; kept as text (actors get plain values)."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @model_validator(mode="after")
    def _check_across_fields(self) -> "ClusterConfig":
        """The rules of ``RULES``; parses the delay levels (the only time they are parsed)."""
        try:
            levels = parse_delay_levels(self.delay_levels)
        except ConfigError as err:
            raise ConfigError(f"delay_levels {self.delay_levels!r}: {err}") from None
        if self.retry_first_level > len(levels):
            raise ConfigError(f"retry_first_level {self.retry_first_level} is past the last "
                              f"delay level ({len(levels)})")
        if self.kafka_txn_timeout_ms > self.max_txn_timeout_ms:
            raise ConfigError(f"kafka_txn_timeout_ms ({self.kafka_txn_timeout_ms}) is over "
                              f"max_txn_timeout_ms ({self.max_txn_timeout_ms})")
        if self.session_timeout_ms <= self.heartbeat_interval_ms:
            raise ConfigError(f"session_timeout_ms ({self.session_timeout_ms}) must be longer "
                              f"than heartbeat_interval_ms ({self.heartbeat_interval_ms})")
        if self.disk_clean_ratio > self.disk_full_ratio:
            raise ConfigError(f"disk_clean_ratio ({self.disk_clean_ratio}) must not be over "
                              f"disk_full_ratio ({self.disk_full_ratio})")
        if self.min_insync_replicas > self.replication_factor:
            raise ConfigError(f"min_insync_replicas ({self.min_insync_replicas}) is over "
                              f"replication_factor ({self.replication_factor})")
        try:
            self.store_config()
        except ConfigError as err:
            raise ConfigError(f"segment_size_bytes {self.segment_size_bytes} with "
                              f"max_message_bytes {self.max_message_bytes}: the storage "
                              f"refuses them: {err}") from None
        self._delay_levels_ms = levels
        return self

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        """The delay of level k (from 1) at index k - 1, in ms."""
        # (read where pydantic keeps private attributes: ``self._delay_levels_ms`` goes
        # through its ``__getattr__``, ~5 us, and producers ask for this on every send)
        return self.__pydantic_private__["_delay_levels_ms"]

    @property
    def min_insync(self) -> int:
        """``min_insync_replicas`` with its default resolved."""
        return self.min_insync_replicas or min(2, self.replication_factor)

    def resolved_data_dir(self, node: str | None = None) -> str:
        """The data directory; a ``{node}`` in it is the Ray node id of the replica that
        keeps its files there (the first 12 characters; ``main`` for the other actors):
        nodes sharing a disk, as in tests on one machine, keep apart."""
        return self.data_dir_template().replace("{node}", node[:12] if node else "main")

    def data_dir_template(self) -> str:
        return self.data_dir or default_data_dir()

    def store_config(self) -> StoreConfig:
        return StoreConfig(flush_mode=self.flush_mode, segment_size_bytes=self.segment_size_bytes,
                           max_message_bytes=self.max_message_bytes,
                           max_frame_bytes=max(8 * 1024 * 1024,
                                               self.max_message_bytes + 128 * 1024),
                           max_open_queue_files=self.max_open_queue_files,
                           max_open_segments=self.max_open_segments)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (plain values): what actors receive and ``from_dict`` takes."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "ClusterConfig":
        """A config from a mapping; unknown keys and bad values are a ``ConfigError``."""
        if values is not None and not isinstance(values, Mapping):
            raise ConfigError(f"a {cls.__name__} is a mapping of settings, "
                              f"got {type(values).__name__}")
        return cls(**dict(values or {}))

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        """(name, default, doc) of every field, in declaration order."""
        return [(name, f.default, f.description or "") for name, f in cls.model_fields.items()]

    @classmethod
    def type_text(cls, name: str) -> str:
        """The type and constraint of a field, as help texts show it: ``int >= 1``,
        ``'sync' | 'async'``, ``bool``, ``str``."""
        field = cls.model_fields[name]
        if get_origin(field.annotation) is Literal:
            return " | ".join(repr(a) for a in get_args(field.annotation))
        text = getattr(field.annotation, "__name__", str(field.annotation))
        bound = _lower_bound(cls, name)
        return text if bound is None else f"{text} >= {bound}"


def _lower_bound(cls: type[BaseModel], name: str) -> int | None:
    for meta in cls.model_fields[name].metadata:
        if getattr(meta, "ge", None) is not None:
            return meta.ge
    return None


def _config_error(cls: type[BaseModel], err: ValidationError) -> ConfigError:
    """pydantic's report as one line naming each field at fault."""
    problems, unknown = [], []
    for e in err.errors():
        name = str(e["loc"][0]) if e["loc"] else ""
        got = e.get("input")
        kind = e["type"]
        if kind == "extra_forbidden":
            unknown.append(name)
        elif kind == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            problems.append(str(e["ctx"]["error"]))  # a model validator's own words
        elif kind in ("int_type", "int_parsing", "greater_than_equal"):
            bound = _lower_bound(cls, name)
            problems.append(f"{name} must be an integer{'' if bound is None else f' >= {bound}'}"
                            f", got {got!r}")
        elif kind in ("bool_type", "bool_parsing"):
            problems.append(f"{name} must be true or false, got {got!r}")
        elif kind == "literal_error":
            problems.append(f"{name} must be one of {e['ctx']['expected']}, got {got!r}")
        elif kind == "string_type":
            problems.append(f"{name} must be a string, got {got!r}")
        else:
            problems.append(f"{name}: {e['msg']}, got {got!r}")
    if unknown:
        problems.insert(0, f"unknown {cls.__name__} key(s): {', '.join(sorted(unknown))}; "
                           f"known keys: {', '.join(sorted(cls.model_fields))}")
    return ConfigError("; ".join(problems))
