"""KIP-447: a TxnOffsetCommit (v3 on) names the consumer's generation and member, and the
group refuses it from a member of an older generation (ILLEGAL_GENERATION) or one it does
not know (UNKNOWN_MEMBER_ID), as Kafka does -- the client then aborts its transaction.
Without it, an instance that lost its partitions in a rebalance (a zombie) still
committed its output and offsets: the input was processed twice.  Pure: the listener's
``KafkaApis`` and its group coordinator, no shard reached (refused before)."""
from __future__ import annotations

from kafka.protocol.producer.transaction import TxnOffsetCommitRequest

from raymq.wire import groups as G
from raymq.wire.apis import KafkaApis
from tests.wire.test_groups import joined_together

_Topic = TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic
_Part = _Topic.TxnOffsetCommitRequestPartition


class _Routes:
    """The one ``mq`` call made before the group is asked: topic ``t`` on shard 0."""

    def routes_for(self, topics):
        return {t: [0] for t in topics}


def _commit(apis, generation: int, member: str) -> int:
    request = TxnOffsetCommitRequest(
        version=3, transactional_id="tx", group_id="grp", producer_id=1, producer_epoch=0,
        generation_id=generation, member_id=member, group_instance_id=None,
        topics=[_Topic(name="t", partitions=[_Part(partition_index=0, committed_offset=5,
                                                   committed_leader_epoch=-1,
                                                   committed_metadata="")])])
    [topic] = apis.handle(request).topics
    [part] = topic.partitions
    return part.error_code


def test_a_zombie_generation_or_an_unknown_member_cannot_commit_offsets_in_a_transaction():
    groups = G.ClassicGroups(initial_delay_s=0.05)
    apis = KafkaApis(_Routes(), "localhost", 0, groups=groups)
    assert {j.generation for j in joined_together(groups, "a", "b").values()} == {1}
    assert groups.leave("grp", ["b"]) == [G.NONE]               # b's partitions move to a
    assert groups.join("grp", "a", "consumer", [("range", b"")], 6000, 1000).generation == 2
    assert _commit(apis, 1, "a") == G.ILLEGAL_GENERATION      # a zombie of generation 1
    assert _commit(apis, 2, "b") == G.UNKNOWN_MEMBER_ID       # one that left
