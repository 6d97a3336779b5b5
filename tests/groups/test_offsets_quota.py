"""A shard takes committed offsets of at most ``max_groups`` groups; a group whose offsets
were all deleted (Kafka's OffsetDelete, ``raymq group delete``) no longer counts: with
rotating group names (console consumers, versioned names) every new group's commit was
refused for good once ``max_groups`` had ever committed, though no offsets were left.
The shard's own progress keys never count.  In-process shard, no Ray."""
from __future__ import annotations

import pytest

from raymq.storage import RecordBatch
from raymq.storage.errors import QuotaExceededError
from tests.helpers import open_shard


def test_a_group_whose_offsets_were_deleted_no_longer_counts_against_max_groups(tmp_path):
    sh = open_shard(tmp_path, [("t", 0)], max_groups=3)
    try:
        sh.send(RecordBatch("t", 0, [b"a", b"b"]))
        for g in ("a", "b", "c"):
            sh.commit_offsets(g, {("t", 0): 1})
        with pytest.raises(QuotaExceededError):
            sh.commit_offsets("d", {("t", 0): 1})
        for g in ("a", "b"):
            sh.delete_offsets(g, [("t", 0)])
        sh.commit_offsets("d", {("t", 0): 2})
        sh.commit_offsets("e", {("t", 0): 2})
        with pytest.raises(QuotaExceededError):
            sh.commit_offsets("f", {("t", 0): 2})
    finally:
        sh.close()
    sh = open_shard(tmp_path, [("t", 0)], max_groups=3)
    try:  # (reopened: the same three groups count, not the shard's own keys)
        with pytest.raises(QuotaExceededError):
            sh.commit_offsets("f", {("t", 0): 2})
        sh.commit_offsets("c", {("t", 0): 2})
    finally:
        sh.close()
