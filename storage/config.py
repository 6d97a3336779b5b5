"""Storage configuration: a frozen dataclass, units in the names, validated.
Owns ``StoreConfig``, its defaults, documentation and checks.

``from_dict`` rejects unknown keys, so a typo in a config file is an error
rather than a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from raymq.storage.errors import ConfigError

T = TypeVar("T")

FLUSH_MODES = ("sync", "async")
#: Upper bound of what a record adds to its body: header, topic, key, tags, properties.
RECORD_OVERHEAD_MAX_BYTES = 128 * 1024


def doc(text: str, default: Any) -> Any:
    """A dataclass field with a docstring kept in its metadata."""
    return field(default=default, metadata={"doc": text})


def config_from_dict(cls: type[T], values: Mapping[str, Any] | None) -> T:
    """Build a config dataclass from a mapping; unknown keys are an error."""
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s): {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(known))}")
    return cls(**values)


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, doc) of every field, for ``--help`` texts and docs."""
    return [(f.name, f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(cls)]


def _positive_int(obj: Any, name: str, *, minimum: int = 1) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class StoreConfig:
    segment_size_bytes: int = doc(
        "Size of one commit-log segment file; a batch never spans two.", 64 * 1024 * 1024)
    flush_mode: str = doc(
        "'sync': fsync (group commit) before a put returns; "
        "'async': a background flush every flush_interval_ms.", "sync")
    flush_interval_ms: int = doc(
        "Period of the background flush in async mode, and of consume-queue "
        "checkpoints in both modes.", 500)
    flush_timeout_ms: int = doc(
        "A sync put whose fsync takes longer returns FLUSH_DISK_TIMEOUT "
        "(the data is written, its durability is not confirmed).", 5000)
    max_message_bytes: int = doc(
        "Largest body accepted; bigger messages are rejected with a clear error.",
        4 * 1024 * 1024)
    producer_expiry_ms: int = doc(
        "An idempotent producer not seen for this long is forgotten (its next put "
        "is accepted whatever its sequence).", 7 * 24 * 3600 * 1000)
    max_frame_bytes: int = doc(
        "A put is written as CRC-framed batches of at most this many bytes.",
        8 * 1024 * 1024)
    max_open_queue_files: int = doc(
        "Most consume-queue files open at once: the least recently used are closed and "
        "opened again on demand, so a store may hold any number of queues.  At most half "
        "the process's descriptor limit (ulimit -n) is used, whatever this says: commit-log "
        "segments and sockets need descriptors too.  A checkpoint holds one more while it "
        "fsyncs a queue.", 1024)
    max_open_segments: int = doc(
        "Most sealed commit-log segments open at once (the one written to is always "
        "open): the least recently read are closed and opened again on demand.", 64)

    def __post_init__(self) -> None:
        _positive_int(self, "segment_size_bytes", minimum=4096)
        _positive_int(self, "flush_interval_ms")
        _positive_int(self, "flush_timeout_ms")
        _positive_int(self, "max_message_bytes")
        _positive_int(self, "producer_expiry_ms")
        _positive_int(self, "max_frame_bytes", minimum=1024)
        _positive_int(self, "max_open_queue_files")
        _positive_int(self, "max_open_segments")
        if self.flush_mode not in FLUSH_MODES:
            raise ConfigError(
                f"flush_mode must be one of {FLUSH_MODES}, got {self.flush_mode!r}")
        if self.max_frame_bytes < self.max_message_bytes + RECORD_OVERHEAD_MAX_BYTES:
            raise ConfigError("max_frame_bytes must hold one largest message "
                              f"(max_message_bytes + {RECORD_OVERHEAD_MAX_BYTES})")
        if self.max_frame_bytes > self.segment_size_bytes - 64:
            raise ConfigError("max_frame_bytes must leave room in a segment "
                              "(segment_size_bytes - 64)")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "StoreConfig":
        return config_from_dict(cls, values)
