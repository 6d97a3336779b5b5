"""RocketMQ-style transactions: the application's side of the contract."""
from __future__ import annotations

import enum


class LocalTransactionState(enum.Enum):
    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"  # RocketMQ's spelling: the outcome is not known yet


class TransactionListener:
    """Implemented by the application; runs in the application's process."""

    def execute_local_transaction(self, msg, arg) -> LocalTransactionState:
        """Run the local (database) transaction of a half message that was stored."""
        raise NotImplementedError

    def check_local_transaction(self, msg) -> LocalTransactionState:
        """Answer a broker check-back: did the local transaction of ``msg`` commit?"""
        raise NotImplementedError
