"""What the controller says of a replica group (``Assignment``), and what each replica
keeps of it beside its log: the last assignment it was told (``group.json``) and the
controller's topics and routes (``controller-meta.json``) -- a controller that lost its
files takes both back from the replicas.  Pure Python: no Ray.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("raymq.replica")


@dataclass(frozen=True)
class Assignment:
    """What the controller says of a group: who leads with which epoch, who is in sync."""

    epoch: int
    leader: str | None
    in_sync: tuple[str, ...]
    replicas: tuple[str, ...]
    version: int = 0  # the group's version (Kafka's partition epoch): every change bumps it

    @classmethod
    def of(cls, doc: dict) -> "Assignment":
        return cls(doc["epoch"], doc["leader"], tuple(doc["in_sync"]), tuple(doc["replicas"]),
                   doc.get("version", 0))


#: The assignment a replica was last told, kept beside its log: a controller that lost its
#: files takes each group's state from what the group's replicas keep.
KEPT_ASSIGNMENT = "group.json"


#: The controller's topics and routes, as a replica keeps them (``Controller._mirror``).
KEPT_METADATA = "controller-meta.json"


def read_kept(directory: str, name: str = KEPT_ASSIGNMENT) -> dict | None:
    try:
        with open(os.path.join(directory, name), "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError:  # (written atomically: damage is the disk's; the others report)
        log.warning("%s: %s is damaged; not reported", directory, name)
        return None
    return doc if isinstance(doc, dict) else None
