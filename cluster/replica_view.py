"""What operators see of replicated groups (shards' and transaction coordinators'): a
group as ``Admin.replicas()`` / ``Admin.coordinator_replicas()`` give it, built from the
controller's ``describe()``; who could be elected now and why the others could not (the
controller's ``candidacy``); which replica ``elect --to`` names; and the one line saying
what an unclean election may have lost.  Pure: no Ray."""
from __future__ import annotations

from raymq.storage.errors import InvalidMessageError

#: the kinds of replicated groups: what ``Admin.elect(kind=...)`` takes
KINDS = ("shard", "coordinator")
#: a candidacy of a replica that may lead now
CAN_LEAD = ("leader", "electable")


def group_doc(g: dict, kind: str = "shard") -> dict:
    """One group of the controller's ``describe()`` (``shard``, ``leader``, ``epoch``,
    ``in_sync``, ``replicas``, ``nodes``, ``alive``, ``log_end``, ``candidacy``) as the
    admin API gives it: ``<kind>`` (the index), ``kind``, ``group`` (e.g.
    ``coordinator-0``), ``leader`` (a replica name), ``leader_node`` (a Ray node id),
    ``epoch``, ``in_sync`` (node ids; None for a replica not heard from since the
    controller started), ``in_sync_replicas`` (names), ``electable`` (the
    other replicas that could lead now), ``candidacy`` (name -> ``leader``,
    ``electable`` or why not) and ``replicas`` (each ``name``, ``node``, ``role``,
    ``alive``, ``log_end`` (None: never reported), ``lag_bytes`` (how far behind the
    leader's log end at the last heartbeats) and ``candidacy``)."""
    nodes, ends, leader = g["nodes"], g["log_end"], g["leader"]
    cand = g.get("candidacy") or {}
    top = ends.get(leader, -1)
    return {kind: g["shard"], "kind": kind, "group": f"{kind}-{g['shard']}", "leader": leader,
            "leader_node": nodes.get(leader) or None, "epoch": g["epoch"],
            "in_sync": [nodes.get(r) or None for r in g["in_sync"]],
            "in_sync_replicas": list(g["in_sync"]),
            "electable": [r for r in g["replicas"] if cand.get(r) == "electable"],
            "candidacy": {r: cand.get(r, "unknown") for r in g["replicas"]},
            "replicas": [{"name": r, "node": nodes[r],
                          "role": "leader" if r == leader else "follower",
                          "alive": r in g["alive"],
                          "log_end": ends[r] if ends[r] >= 0 else None,
                          "lag_bytes": max(0, top - ends[r]) if ends[r] >= 0 else None,
                          "candidacy": cand.get(r, "unknown")} for r in g["replicas"]]}


def not_electable(doc: dict) -> dict[str, str]:
    """The replicas of a group that could not lead now, each with why."""
    return {r: why for r, why in doc["candidacy"].items() if why not in CAN_LEAD}


def electable_line(doc: dict) -> str:
    """Who could be elected now and why the others could not, in one line (``raymq
    status``), with the way out when nobody could lead."""
    out = f"electable now: {', '.join(doc['electable']) or 'none'}"
    why = not_electable(doc)
    if why:
        out += "; not: " + "; ".join(f"{r} ({w})" for r, w in why.items())
    if not doc["electable"] and "leader" not in doc["candidacy"].values() and \
            any(r["alive"] for r in doc["replicas"]):
        out += (f" -- `raymq {doc['kind']} elect {doc[doc['kind']]} --unclean` elects an "
                "alive replica anyway (acknowledged records may be lost)")
    return out


def replica_named(doc: dict, to: str) -> str:
    """The replica of a group that ``elect --to`` names: its name (``shard-0-r2``), or its
    Ray node id or the id's first characters."""
    names = [r["name"] for r in doc["replicas"]]
    if to in names:
        return to
    on = [r["name"] for r in doc["replicas"] if r["node"] and r["node"].startswith(to)]
    if len(on) != 1:
        where = ", ".join(f"{r['name']} on node {r['node'] or '?'}" for r in doc["replicas"])
        raise InvalidMessageError(f"no replica of {doc['group']} named {to!r} or on a node "
                                  f"starting so (its replicas: {where})")
    return on[0]


def unclean_note(before: dict, new: str | None) -> str:
    """One line: what an unclean election that made ``new`` lead may have lost, from the
    group as ``group_doc`` gave it just before (each replica's log end as last reported):
    the records acknowledged after ``new`` fell behind -- at most the old leader's log
    end (else the most another replica reported) less ``new``'s."""
    why = before["candidacy"].get(new, "unknown")
    if why in CAN_LEAD:
        return f"unclean election: {new} was in sync; nothing acknowledged is lost"
    was = "was not in sync" if why == "not in sync" else f"was not electable ({why})"
    lost = f"unclean election: {new} {was}; records acknowledged after it fell behind"
    ends = {r["name"]: r["log_end"] for r in before["replicas"]}
    old = before["leader"]
    if old and old != new and ends.get(old) is not None:
        ref, whose = ends[old], f"the old leader's ({old})"
    else:
        others = {r: e for r, e in ends.items() if r != new and e is not None}
        if not others:
            return f"{lost} may be lost (how many is unknown: no other replica reported its log)"
        top = max(sorted(others), key=others.get)
        ref, whose = others[top], f"{top}'s (the most another replica reported)"
    mine = ends.get(new)
    if mine is None:
        return f"{lost} may be lost (up to {ref} bytes: its log end is unknown, {whose} at {ref})"
    return (f"{lost} (up to {max(0, ref - mine)} bytes: its log ends at {mine}, {whose} at "
            f"{ref}) may be lost")
