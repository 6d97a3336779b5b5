"""Pure-Python storage engine of a RayMQ shard: the package's public names.
Owns the re-exports of the store, its config, clock, records and errors.

Commit log (append-only, segmented, CRC-framed record batches), consume queues
(fixed 20-byte index entries per topic queue), durable offsets and recovery.
Nothing in this package imports Ray: it is used by the shard actor and tested
on plain files.
"""
from raymq.storage.clock import Clock, ManualClock, SystemClock
from raymq.storage.config import StoreConfig
from raymq.storage.errors import (
    ConfigError,
    CorruptLogError,
    MessageTooLargeError,
    RayMQError,
    StorageError,
)
from raymq.storage.records import Record, RecordBatch, StoredMessage, SysFlag
from raymq.storage.store import MessageStore, PutResult, PutStatus

__all__ = [
    "Clock", "ManualClock", "SystemClock", "StoreConfig", "ConfigError",
    "CorruptLogError", "MessageTooLargeError", "RayMQError", "StorageError",
    "Record", "RecordBatch", "StoredMessage", "SysFlag", "MessageStore", "PutResult", "PutStatus",
]
