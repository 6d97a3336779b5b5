"""CheckerWorker: runs the check-back rounds for a set of shards.

Every ``txn_check_interval_ms`` it asks the registries which producer groups
have a live instance, lets each of its shards plan and record a round
(``BrokerShard.check_round``: re-puts, expiries, durable progress) and hands
the resulting check requests to the group's registry, where any live
producer instance takes them.  It never waits for a listener, so a slow
listener or a bad half cannot stall a round.  Its progress lives in the
shards, so a restarted checker resumes where the last one stopped.
"""
from __future__ import annotations

import logging
import os
import threading
import zlib
from typing import Callable

from raymq.actors.protocol import CheckRequest

log = logging.getLogger("raymq.checker")


def registry_for(group: str, num_registries: int) -> int:
    return zlib.crc32(group.encode()) % num_registries


class CheckerWorker:
    def __init__(self, index: int, shards: list[int], *, call_shard: Callable,
                 call_registry: Callable, num_registries: int, interval_ms: int,
                 max_checks_per_group: int, background: bool = True):
        self.index = index
        self.shards = shards
        self._call_shard = call_shard        # (shard, method, *args, **kwargs) -> result
        self._call_registry = call_registry  # (registry, method, *args) -> result
        self.num_registries = num_registries
        self.interval_ms = interval_ms
        self.max_checks_per_group = max_checks_per_group
        self.rounds = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"raymq-checker-{index}",
                                            daemon=True)
            self._thread.start()

    def run_round(self) -> dict:
        """One round over every shard; returns how many checks went to each group.

        A group's ``max_checks_per_group`` holds across all the shards of the
        round.  A registry that cannot be asked which groups are live makes its
        groups wait (nothing of theirs is counted); checks a registry did not
        queue are taken back from their shard.
        """
        live: list[str] = []
        for r in range(self.num_registries):
            try:
                live += self._call_registry(r, "live_groups")
            except Exception as err:  # its groups wait this round; the others go on
                log.warning("checker-%d: registry-%d unavailable: %s", self.index, r, err)
                self.last_error = f"registry-{r}: {err}"
        sent: dict[str, int] = {}
        k = self.rounds % len(self.shards) if self.shards else 0
        # each round starts at another shard: one shard's backlog of a group must not
        # use up the group's checks in every round
        for shard in self.shards[k:] + self.shards[:k]:
            try:
                requests = self._call_shard(shard, "check_round", sorted(set(live)),
                                            max_checks_per_group=self.max_checks_per_group,
                                            checks_used=dict(sent))
            except Exception as err:  # one shard down must not stop the others
                log.warning("checker-%d: shard-%d round failed: %s", self.index, shard, err)
                self.last_error = f"shard-{shard}: {err}"
                continue
            by_group: dict[str, list[CheckRequest]] = {}
            for req in requests:
                by_group.setdefault(req.group, []).append(req)
            for group, reqs in by_group.items():
                try:
                    refused = self._call_registry(registry_for(group, self.num_registries),
                                                  "push_checks", group, reqs)
                except Exception as err:  # nobody was asked: the checks must not count
                    log.warning("checker-%d: registry unavailable for %s: %s; taking back "
                                "%d checks", self.index, group, err, len(reqs))
                    self.last_error = f"registry: {err}"
                    refused = [(shard, r.origin, r.checks) for r in reqs]
                sent[group] = sent.get(group, 0) + len(reqs) - len(refused)
                if refused:
                    self._take_back(shard, [(origin, checks) for _s, origin, checks in refused])
        self.rounds += 1
        return {g: n for g, n in sent.items() if n}

    def _take_back(self, shard: int, checks: list[tuple[int, int]]) -> None:
        try:
            self._call_shard(shard, "uncount_checks", checks)
        except Exception as err:  # the back-off still spaces the next check
            log.warning("checker-%d: shard-%d could not take back checks: %s",
                        self.index, shard, err)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_round()
            except Exception as err:  # the loop never dies; next round retries
                log.exception("checker-%d: round failed", self.index)
                self.last_error = str(err)
            self._wake.wait(self.interval_ms / 1000.0)
            self._wake.clear()

    def ping(self) -> dict:
        return {"checker": self.index, "pid": os.getpid()}

    def status(self) -> dict:
        return {"checker": self.index, "shards": self.shards, "rounds": self.rounds,
                "last_error": self.last_error}

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
