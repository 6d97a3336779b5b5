"""The ``raymq`` command line: argument parsing and one function per command; attaching
to Ray goes through ``raymq.rpc.init``, everything else through the SDK."""
from __future__ import annotations

import argparse
import re
import json
import logging
import sys
import time

DESCRIPTION = """RayMQ: a transactional message broker on Ray actors, feeding Spark through RayDP.

Cluster commands attach to the running Ray cluster (--address, $RAY_ADDRESS, or
the cluster started on this machine with `ray start --head` / `ray up`); only `up`
deploys RayMQ there, the others say so when it is not deployed.

  up                 deploy RayMQ's actors into the cluster (idempotent; a running
                     RayMQ keeps its settings: other ones are refused)
  down               stop RayMQ's actors (data stays on disk)
  status             shards, nodes, topics, queue depths, consumer groups and lag;
                     replicated groups: leader, in-sync set, who could be elected
  shard elect        make another replica lead a replicated shard (--to, --unclean)
  coordinator elect  the same for a replicated transaction coordinator
  topic create|alter|describe|delete|list  manage topics and their retention
  send               send messages (body arguments, or lines of stdin with -)
  consume            consume messages of a group and print them
  group reset-offsets  move a consumer group's offsets (earliest, latest, a time, an offset)
  dlq list|resend    inspect and redeliver a group's dead letters
  msg show|find      look a message up by id, or by topic and key
  half list|commit|rollback  pending transactional half messages (and expired ones)
  tx list|describe|abort|hanging  Kafka-style transactions (coordinators and shards)
  job order-income   the Spark order-income job (RayDP in this cluster), once or every N s
  demo               the main demonstration on an embedded local cluster
  bench              benchmark suites: JSON lines on stdout, progress on stderr
  config             every cluster setting (--describe), or the settings of --config
  console            the web console: pages and JSON for operators (localhost by default)
  kafka              a Kafka-protocol listener: Kafka clients produce and consume here
"""


def _attach(args) -> None:
    """Attach to the command's Ray cluster: --address, else $RAY_ADDRESS, else the one of
    this machine; never an embedded one.  A cluster that does not answer or refuses this
    process is one line saying what to fix (``raymq.rpc.init``)."""
    from raymq import rpc
    if not rpc.connected():
        rpc.init(args.address or "auto", logging_level=logging.WARNING)


def _config_file(args) -> dict:
    """The settings of --config (checked: a bad file or setting is one line), or {}."""
    from raymq.actors.config import ClusterConfig
    if not getattr(args, "config", None):
        return {}
    with open(args.config) as f:
        settings = json.load(f)
    ClusterConfig.from_dict(settings)
    return settings


def _connect(args, *, settings: dict | None = None):
    """Attach to RayMQ on the command's Ray cluster (``_attach``).  Deploys nothing --
    RayMQ not deployed is one NOT_DEPLOYED line naming `raymq up` -- unless ``settings``
    are given (``up`` only): then RayMQ is deployed with them (as many shards as the
    cluster places, unless asked), or, when it runs already, they must agree with its
    own (CONFIG_MISMATCH naming the differences otherwise; ``deploy.settings_for_up``).
    Other commands only check --config (it is `up`'s)."""
    from raymq import deploy
    from raymq.client import connect
    if settings is None:
        _config_file(args)
    _attach(args)
    if settings is None:
        return connect(deploy=False)
    return connect(deploy=True, config=deploy.settings_for_up(settings))


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _cmd_up(args) -> int:
    settings = _config_file(args)
    if args.num_shards:
        settings["num_shards"] = args.num_shards
    if args.data_dir:
        settings["data_dir"] = args.data_dir
    if args.replication_factor:
        settings["replication_factor"] = args.replication_factor
    if args.min_insync_replicas:
        settings["min_insync_replicas"] = args.min_insync_replicas
    if args.kafka_port is not None:
        settings["kafka_port"] = args.kafka_port
    mq = _connect(args, settings=settings)
    print(f"RayMQ is up: controller + {mq.num_shards} shards "
          f"(data under {mq.config.resolved_data_dir()} on each node)")
    if mq.config.kafka_port:
        print(f"Kafka clients: bootstrap.servers={mq.kafka_bootstrap()}")
    return 0


def _cmd_down(args) -> int:
    from raymq.deploy import undeploy
    _attach(args)
    killed = undeploy()
    print(f"stopped: {', '.join(killed) or 'nothing was running'} (data kept on disk)")
    return 0


def _print_replicas(groups: list[dict], title: str = "replicas") -> None:
    """Each replicated group: its leader, epoch and in-sync set, who could be elected now
    and why the others could not, and each replica's role, liveness, lag and candidacy."""
    from raymq.replica_view import electable_line
    print(f"{title}:")
    for g in groups:
        name = g.get("group", f"shard-{g.get('shard')}")
        print(f"  {name}: leader on node {str(g['leader_node'])[:12]}  epoch "
              f"{g['epoch']}  in sync {len(g['in_sync'])}/{len(g['replicas'])} "
              f"({', '.join(g.get('in_sync_replicas') or map(str, g['in_sync']))})")
        if "candidacy" in g:
            print(f"    {electable_line(g)}")
        for r in g["replicas"]:
            lag = "?" if r["lag_bytes"] is None else f"{r['lag_bytes']} bytes"
            print(f"    {r['name']}: {r['role']:8s} node {str(r['node'])[:12] or '-':12s} "
                  f"{'alive' if r['alive'] else 'DEAD '}  lag {lag}"
                  + (f"  ({r['candidacy']})" if r.get("candidacy", "leader") != "leader"
                     else ""))


def _cmd_elect(args) -> int:
    """`raymq shard elect` and `raymq coordinator elect`."""
    mq = _connect(args)
    g = mq.admin.elect(args.index, args.to, unclean=args.unclean, kind=args.kind)
    print(f"{g['group']}: leader on node {str(g['leader_node'])[:12]} ({g['leader']}), "
          f"epoch {g['epoch']}")
    if "unclean" in g:
        print(g["unclean"])
    return 0


def _cmd_status(args) -> int:
    mq = _connect(args)
    st = mq.admin.status()
    if args.json:
        _print_json(st)
        return 0
    print(f"transport: {st['transport']['name']} -- {st['transport']['why']}")
    if mq.config.kafka_port:
        print(f"kafka listeners: {mq.kafka_bootstrap() or 'none answering'}")
    print(f"shards: {len(st['shards'])}")
    for s in st["shards"]:
        info = s["info"]
        if "error" in info:
            print(f"  shard-{s['shard']}: UNAVAILABLE ({info['error']})")
            continue
        depth = sum(info["queues"].values())
        print(f"  shard-{s['shard']}: node {str(s['node'])[:12]}  queues {len(info['queues'])}  "
              f"messages {depth}  log {info['log_bytes']} bytes  "
              f"delayed pending {sum(info['schedule_pending'].values())}  "
              f"max delay lateness {info['max_delay_lateness_ms']} ms")
        tm = info.get("timers")
        if tm:
            print(f"    timers: {tm['scheduled']} scheduled (next minute {tm['next_minute']}, "
                  f"hour {tm['next_hour']}, day {tm['next_day']}, later {tm['later']})  "
                  f"delivery lag {tm['lag_ms']} ms  max lateness {tm['max_lateness_ms']} ms  "
                  f"cancelled pending {tm['cancelled']}")
        ret = info.get("retention")
        if ret:
            print(f"    retention: log starts at {ret['log_start_phys']}, "
                  f"{ret['deleted_segments']} segments ({ret['deleted_bytes']} bytes) deleted; "
                  f"disk {100 * ret['disk_used_ratio']:.0f}% used, {ret['disk_free_bytes']} "
                  f"bytes free{'  WRITES REFUSED: disk full' if ret['disk_full'] else ''}"
                  + (f"; the oldest segment is kept by {ret['oldest_held_by']} "
                     f"({ret.get('oldest_held_bytes', 0)} bytes of it)"
                     if ret['oldest_held_by'] else ""))
    if "replicas" in st:
        _print_replicas(st["replicas"])
    if st.get("coordinator_replicas"):
        _print_replicas(st["coordinator_replicas"], "coordinator replicas")
    print(f"topics: {len(st['topics'])}")
    for name, t in st["topics"].items():
        print(f"  {name}: {t['queues']} queues on shards {sorted(set(t['routes']))}")
    lag: dict[str, int] = {}
    for s in st["shards"]:
        for group, lags in s["info"].get("lag", {}).items():
            lag[group] = lag.get(group, 0) + sum(lags.values())
    print(f"consumer groups: {len(st['groups'])}")
    for name, g in st["groups"].items():
        print(f"  {name}: {len(g['members'])} members, lag {lag.get(name, 0)}")
    tx = [t for t in st.get("transactions", []) if "error" not in t]
    waiting = sorted({g for t in tx for g in t["groups_without_live_producer"]})
    print(f"transactions: {sum(t['pending_halves'] for t in tx)} pending halves, "
          f"{sum(t['expired_halves'] for t in tx)} expired"
          + (f"; waiting for a live producer of: {', '.join(waiting)}" if waiting else ""))
    return 0


_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_SIZE_BYTES = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def duration_ms(text: str) -> int:
    """``6h`` -> 21600000 (units ms, s, m, h, d)."""
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: a number and one of "
                                         f"ms, s, m, h, d (e.g. 6h)")
    return int(m.group(1)) * _DURATION_MS[m.group(2)]


def size_bytes(text: str) -> int:
    """``10GiB`` -> 10737418240; ``-1``: no limit."""
    if text.strip() == "-1":
        return -1
    m = re.fullmatch(r"(\d+)\s*([kmgt]i?b|b)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a number and one of B, KB, "
                                         f"MB, GB, TB, KiB, MiB, GiB, TiB (or -1: no limit)")
    return int(m.group(1)) * _SIZE_BYTES[m.group(2) or ""]


def _topic_line(t: dict) -> str:
    size = "no limit" if t.get("retention_bytes", -1) == -1 else f"{t['retention_bytes']} bytes"
    return (f"topic {t['topic']}: {t['queues']} queues on shards {t['routes']}; retention "
            f"{t.get('retention_ms', 0) / 3_600_000:g} h, {size} per queue")


def _cmd_topic(args) -> int:
    mq = _connect(args)
    if args.topic_cmd == "create":
        print(_topic_line(mq.create_topic(args.name, args.queues, retention_ms=args.retention,
                                          retention_bytes=args.retention_bytes)))
    elif args.topic_cmd == "alter":
        print(_topic_line(mq.alter_topic(args.name, retention_ms=args.retention,
                                         retention_bytes=args.retention_bytes,
                                         queues=args.queues)))
    elif args.topic_cmd == "describe":
        print(_topic_line(mq.describe_topic(args.name)))
    elif args.topic_cmd == "delete":
        info = mq.delete_topic(args.name)
        print(f"topic {info['topic']} deleted ({info['queues']} queues); its records are given "
              f"back with their segments")
        for shard, why in info["pending"].items():
            print(f"  {shard} drops it later: {why}")
    else:
        for name, t in mq.topics().items():
            print(f"{name}\t{t['queues']} queues")
    return 0


def iso_ms(text: str) -> int:
    """An ISO 8601 time (UTC unless it names a zone) in ms since the epoch."""
    from datetime import datetime, timezone
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise SystemExit(f"raymq: {text!r} is not an ISO 8601 time (e.g. "
                         f"2026-11-27T18:00:00 or 2026-11-27T18:00:00+01:00)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return int(t.timestamp() * 1000)


def _cmd_group(args) -> int:
    mq = _connect(args)
    if args.to_earliest:
        to, value = "earliest", None
    elif args.to_latest:
        to, value = "latest", None
    elif args.to_datetime is not None:
        to, value = "datetime", iso_ms(args.to_datetime)
    elif args.by_duration is not None:
        to, value = "duration", args.by_duration
    else:
        to, value = "offset", args.to_offset
    plan = mq.admin.reset_offsets(args.group, args.topic, to=to, value=value,
                                  dry_run=args.dry_run)
    for (topic, qid), (before, after) in sorted(plan.items()):
        print(f"{topic}/{qid}\t{before}\t-> {after}")
    print(("would move" if args.dry_run else "moved") + f" the offsets of group "
          f"{args.group} on {len(plan)} queues of {args.topic}"
          + (" (dry run: nothing changed)" if args.dry_run else ""))
    return 0


def _cmd_send(args) -> int:
    from raymq.message import Message
    mq = _connect(args)
    bodies = args.body if args.body != ["-"] else [line.rstrip("\n") for line in sys.stdin]
    if not bodies:
        print("raymq: nothing to send (no body given, or stdin was empty)", file=sys.stderr)
        return 1
    msgs = [Message(args.topic, b.encode(), key=args.key, tags=args.tags,
                    delay_level=args.delay_level, deliver_at_ms=args.deliver_at,
                    deliver_after_ms=args.deliver_after_ms)
            for b in bodies for _ in range(args.repeat)]
    p = mq.producer(args.group)
    try:
        for r in p.send_batch(msgs):
            print(f"{r.status.value}\t{r.msg_id}\t{r.topic}/{r.queue_id}@{r.queue_offset}")
    finally:
        p.close()
    return 0


def _cmd_consume(args) -> int:
    mq = _connect(args)
    c = mq.consumer(args.group, [args.topic], tags=args.tags, read_only=args.no_commit)
    n = 0
    last_s = time.monotonic()  # when the last message came: --timeout is idle time
    told = False
    try:
        while n < args.max and time.monotonic() - last_s < args.timeout:
            got = c.poll(min(100, args.max - n), 0.5)
            for m in got:
                print(f"{m.msg_id}\t{m.topic}/{m.queue_id}@{m.queue_offset}\tkey={m.key}\t"
                      f"tags={m.tags}\t{m.body.decode(errors='replace')}", flush=True)
                n += 1
            if got:
                last_s, told = time.monotonic(), False
                c.commit()  # (a --no-commit consumer is read-only: this commits nothing)
            elif not told and time.monotonic() - last_s > 2.0:
                print(f"waiting for messages ({n} so far; stops after {args.timeout:g} s "
                      "without one, Ctrl-C to stop now)", file=sys.stderr)
                told = True
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        c.close()
    print(f"consumed {n} messages{' (nothing committed)' if args.no_commit else ''}",
          file=sys.stderr)
    return 0


def _cmd_dlq(args) -> int:
    mq = _connect(args)
    if args.dlq_cmd == "list":
        letters = mq.admin.dlq_list(args.group)
        for m in letters:
            print(f"{m.stored_id}\torigin {m.msg_id}\t{m.topic}\treconsumed "
                  f"{m.reconsume_count}\t{m.properties.get('DLQ_REASON', '')}\t"
                  f"{m.body[:60].decode(errors='replace')}")
        print(f"{len(letters)} dead letters of group {args.group}", file=sys.stderr)
    else:
        resent = mq.admin.dlq_resend(args.group, args.ids or None)
        print(f"resent {len(resent)} dead letters to the retry topic of {args.group}")
    return 0


def _cmd_msg(args) -> int:
    mq = _connect(args)
    found = mq.admin.find(args.id) if args.msg_cmd == "show" else \
        mq.admin.find(topic=args.topic, key=args.key)
    for m in found:
        _print_json({"msg_id": m.msg_id, "topic": m.topic, "queue_id": m.queue_id,
                     "queue_offset": m.queue_offset, "key": m.key, "tags": m.tags,
                     "properties": m.properties, "reconsume_count": m.reconsume_count,
                     "born_ms": m.born_ms, "store_ms": m.store_ms,
                     "body": m.body.decode(errors="replace")})
    if not found:
        print("no such message", file=sys.stderr)
        return 1
    return 0


def _cmd_half(args) -> int:
    mq = _connect(args)
    if args.half_cmd == "list":
        halves = mq.admin.half_list(expired=args.expired)
        for h in halves:
            wait = "  (waiting: no live producer in the group)" if h["waiting_for_producer"] else ""
            print(f"{h['id']}\t{h['state']}\tgroup={h['group']}\ttopic={h['topic']}\t"
                  f"age={h['age_ms'] / 1000:.1f}s\tchecks={h['checks']}\t"
                  f"tx={h['transaction_id']}{wait}")
        print(f"{len(halves)} {'expired' if args.expired else 'pending'} half messages",
              file=sys.stderr)
    else:
        print(mq.admin.half_resolve(args.id, args.half_cmd))
    return 0


def _cmd_tx(args) -> int:
    mq = _connect(args)
    if args.tx_cmd == "list":
        txns = mq.admin.tx_list()
        for t in txns:
            age = "" if t["age_ms"] is None else f"\tage={t['age_ms'] / 1000:.1f}s"
            queues = ",".join(f"{q[1]}/{q[2]}" for q in t["queues"]) or "-"
            print(f"{t['transactional_id']}\t{t['state']}\tproducer={t['producer_id']}\t"
                  f"epoch={t['epoch']}{age}\tqueues={queues}")
        print(f"{len(txns)} transactional ids", file=sys.stderr)
    elif args.tx_cmd == "describe":
        print(json.dumps(mq.admin.tx_describe(args.id), indent=2))
    elif args.tx_cmd == "abort":
        print(mq.admin.tx_abort(args.id))
    else:
        hanging = mq.admin.tx_hanging()
        for h in hanging:
            age = "?" if h["age_ms"] is None else f"{h['age_ms'] / 1000:.1f}s"
            print(f"{h['queue']}\tshard-{h['shard']}\tLSO={h['lso']}\tend={h['end']}\t"
                  f"behind={h['behind']}\tage={age}\ttx={h['transactional_id']}\t"
                  f"state={h['state']}\tproducer={h['producer_id']}")
        print(f"{len(hanging)} queue(s) held back by an open transaction", file=sys.stderr)
    return 0


def _cmd_job(args) -> int:
    from raymq.jobs import spark_session
    from raymq.jobs.order_income import run
    mq = _connect(args)
    try:
        with spark_session(mq) as spark:
            run(mq, spark, every_s=None if args.once else args.every, source=args.source,
                target=args.target, group=args.group,
                say=lambda text: print(text, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("order-income: stopped", file=sys.stderr)
    return 0


def _cmd_demo(args) -> int:
    if args.storage:
        from raymq.tools import storage_demo
        return storage_demo.run(args.data_dir)
    from raymq.tools import demo
    if args.orders < demo.MIN_ORDERS:
        print(f"raymq demo: --orders must be at least {demo.MIN_ORDERS} (every failure the "
              "demo injects needs an order of its own)", file=sys.stderr)
        return 2
    return demo.run(args.data_dir, orders=args.orders, sabotage=args.sabotage,
                    spark=not args.no_spark, verbose=args.verbose or args.demo_verbose)


def _cmd_bench(args) -> int:
    import os

    from raymq.tools import suites
    # stdout carries the JSON lines only: anything else written to it (Ray's own
    # messages included) goes to stderr
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        suites.run(args.suites, scale=args.scale, workdir=args.workdir, out=json_out)
    finally:
        json_out.flush()
    return 0


def _cmd_config(args) -> int:
    import textwrap

    from raymq.actors.config import RULES, ClusterConfig
    if not args.describe:  # the settings --config gives, validated, defaults filled in
        values = {}
        if args.config:
            with open(args.config) as f:
                values = json.load(f)
        _print_json(ClusterConfig.from_dict(values).to_dict())
        return 0
    for name, default, doc in ClusterConfig.describe():
        print(f"{name}  ({ClusterConfig.type_text(name)})  default: {json.dumps(default)}")
        print(textwrap.fill(doc, width=92, initial_indent="    ", subsequent_indent="    ",
                            break_on_hyphens=False))
    print("\nrules across settings:")
    for rule in RULES:
        print(f"  - {rule}")
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default."""


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _when_ms(text: str) -> int:
    """A time for the CLI: epoch ms, an ISO 8601 time (UTC unless it says), or +DURATION
    from now (``+500ms``, ``+90s``, ``+10m``, ``+2h``, ``+3d``)."""
    import datetime
    import re
    import time
    t = text.strip()
    m = re.fullmatch(r"\+(\d+)(ms|s|m|h|d)", t)
    if m:
        return int(time.time() * 1000) + int(m.group(1)) * _UNITS_MS[m.group(2)]
    if t.isdigit():
        return int(t)
    try:
        when = datetime.datetime.fromisoformat(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (epoch ms, an ISO time, or +DURATION like +10m)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return int(when.timestamp() * 1000)


def _cmd_timer(args) -> int:
    mq = _connect(args)
    if args.timer_cmd == "list":
        timers = mq.admin.timer_list(args.due_before, args.limit)
        now = int(time.time() * 1000)
        for t in timers:
            print(f"{t['msg_id']}	{t['topic']}/{t['queue_id']}	due_ms={t['due_ms']}	"
                  f"in={(t['due_ms'] - now) / 1000:.1f}s	key={t['key'] or '-'}	"
                  f"tags={t['tags'] or '-'}")
        print(f"{len(timers)} scheduled message(s) due before {args.due_before}"
              + (" (limit reached)" if len(timers) >= args.limit else ""), file=sys.stderr)
    else:
        print(mq.cancel_scheduled(args.id))
    return 0


def _served_cluster(args):
    """The RayMQ a serving command (console, kafka) works on: with --embedded a local Ray
    and RayMQ of its own over --config's data (e.g. the demo's), else the one it joins."""
    if not args.embedded:
        return _connect(args)
    from raymq import rpc
    from raymq.client import connect
    settings = _config_file(args)
    rpc.init("local", include_dashboard=False, logging_level=logging.ERROR)
    return connect(deploy=True, config=settings)


def _until_ctrl_c() -> None:
    print("Ctrl-C to stop", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def _cmd_console(args) -> int:
    from raymq.tools.console import Console, ConsoleServer
    from raymq.tools.console_pages import Pages
    mq = _served_cluster(args)
    console = Console(mq, read_only=args.read_only, pages=Pages(mq, sample_s=args.sample_every))
    server = ConsoleServer(console, args.host, args.port).start()
    try:  # (before the URL is printed: a Ctrl-C as soon as it is seen stops cleanly too)
        print(f"RayMQ console: {server.url}", flush=True)
        if console.token:
            print(f"access token for actions (the page asks once): {console.token}",
                  flush=True)
        else:
            print("read-only: every action is refused", flush=True)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"raymq console: serving on {args.host}: anyone who reaches this port can "
                  "read the cluster's messages", file=sys.stderr)
        _until_ctrl_c()
    except KeyboardInterrupt:
        print("console stopped", file=sys.stderr)
    finally:
        server.stop()
    return 0


def _cmd_kafka(args) -> int:
    from raymq.wire.listener import KafkaListener
    mq = _served_cluster(args)
    listener = KafkaListener(mq, args.host, args.port,
                             advertised_host=args.advertised_host).start()
    try:  # (before the address is printed: a Ctrl-C as soon as it is seen stops cleanly)
        host, port = listener.address
        print(f"RayMQ Kafka listener: bootstrap.servers={args.advertised_host or host}:{port}",
              flush=True)
        _until_ctrl_c()
    except KeyboardInterrupt:
        print("kafka listener stopped", file=sys.stderr)
    finally:
        listener.stop()
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def command_tree(parser: argparse.ArgumentParser, path: str = "raymq", line: str | None = None):
    """(path, parser, its line in its parent's list) of a command and of every command
    under it."""
    yield path, parser, line
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield from command_tree(child, f"{path} {name}", lines.get(name))


def build_parser() -> argparse.ArgumentParser:
    """The command line: every (sub)command's --help shows the defaults and says what
    the command does (its line in its parent's list when it has no description)."""
    parser = _build_parser()
    for _path, command, line in command_tree(parser):
        command.formatter_class = _HelpFormatter
        if command.description is None and line:
            command.description = line[0].upper() + line[1:] + "."
    return parser


def _add_elect(parent: argparse.ArgumentParser, kind: str) -> None:
    """`raymq shard elect I` / `raymq coordinator elect J`."""
    what = "shard" if kind == "shard" else "transaction coordinator"
    actions = parent.add_subparsers(dest=f"{kind}_command", metavar="ACTION", required=True)
    el = actions.add_parser(
        "elect", help=f"make another replica lead {what} I (Kafka's preferred leader "
                      "election; --unclean: even one out of sync)",
        description=f"Make another replica lead {what} I: the one --to names, else the "
                    "in-sync replica holding the most (Kafka's preferred leader election). "
                    "Only an alive in-sync replica whose log holds its epoch may lead; "
                    "otherwise the election is refused, naming each replica's candidacy "
                    "(`raymq status` shows it too). With --unclean, when no such replica "
                    "is alive, an alive one out of the in-sync set is elected, and one line "
                    "says what may be lost: the records acknowledged after it fell behind.")
    el.add_argument("index", type=int, metavar="I", help=f"the {what}'s index")
    el.add_argument("--to", metavar="NAME",
                    help=f"the replica to lead: its name (e.g. {kind}-0-r2) or its Ray "
                         "node id or the id's first characters (default: %(default)s -- "
                         "the in-sync replica with the newest epoch, then the most log, "
                         "other than the leader)")
    el.add_argument("--unclean", action="store_true",
                    help="when no in-sync replica is alive (or may lead), elect an alive "
                         "replica out of the in-sync set anyway: records acknowledged after "
                         "it fell behind may be lost (prints how many bytes at most)")
    el.set_defaults(func=_cmd_elect, kind=kind)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raymq", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    parser.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, or the "
                                          "cluster running on this machine)")
    parser.add_argument("--config", help="JSON file of cluster settings (for `up`)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    up = sub.add_parser("up", help="deploy RayMQ into the running Ray cluster",
                        description="Deploy RayMQ's actors into the running Ray cluster, or "
                                    "start what is missing of them. The settings (--config, "
                                    "--num-shards, --data-dir) are a first deploy's: on a "
                                    "running RayMQ they must be its own, else `up` names each "
                                    "difference and changes nothing (exit status 1).")
    up.add_argument("--num-shards", type=int,
                    help="number of shards (default: as many as the cluster places by "
                         "resources -- ray_config.yaml's RAYMQ_SHARDS -- else 2)")
    up.add_argument("--data-dir", help="data directory on each node")
    up.add_argument("--replication-factor", type=int,
                    help="replicas of each shard, each on its own node (default 1: none); "
                         "refused when the cluster has fewer alive nodes")
    up.add_argument("--min-insync-replicas", type=int,
                    help="replicas holding a write before SEND_OK (default 2 when replicated)")
    up.add_argument("--kafka-port", type=_port,
                    help="a Kafka-protocol listener on each node on this port (anyone "
                         "who reaches it reads and writes every topic); 0: none "
                         "(default: 0)")
    up.set_defaults(func=_cmd_up)
    for kind, line in (("shard", "replicated shards: move leadership"),
                       ("coordinator", "replicated transaction coordinators: move "
                                       "leadership")):
        _add_elect(sub.add_parser(kind, help=line), kind)
    sub.add_parser("down", help="stop RayMQ's actors; data stays").set_defaults(func=_cmd_down)
    st = sub.add_parser("status", help="shards, topics, depths, groups and lag")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_cmd_status)

    topic = sub.add_parser("topic", help="create, alter, describe, delete or list topics")
    tsub = topic.add_subparsers(dest="topic_cmd", required=True, metavar="ACTION")
    tc = tsub.add_parser("create", help="create a topic")
    tc.add_argument("name")
    tc.add_argument("--queues", type=int, help="number of queues (default: cluster default)")
    ta = tsub.add_parser("alter", help="change a topic's retention, or add queues")
    ta.add_argument("name")
    ta.add_argument("--queues", type=_positive_int, metavar="N",
                    help="grow the topic to N queues (never fewer; default: as it is)")
    for p in (tc, ta):
        p.add_argument("--retention", type=duration_ms, metavar="DURATION",
                       help="how long its messages are kept, e.g. 6h, 3d (default: the "
                            "cluster's retention_ms, 3 days)")
        p.add_argument("--retention-bytes", type=size_bytes, metavar="SIZE",
                       help="most bytes each of its queues keeps, e.g. 10GiB; -1: no limit "
                            "(default: the cluster's retention_bytes, no limit)")
    td = tsub.add_parser("describe", help="a topic's queues, shards and retention")
    td.add_argument("name")
    tx_ = tsub.add_parser("delete", help="delete a topic: its messages, queues and groups' "
                          "offsets go (created again, it starts empty)")
    tx_.add_argument("name")
    tsub.add_parser("list", help="list topics")
    topic.set_defaults(func=_cmd_topic)

    send = sub.add_parser("send", help="send messages")
    send.add_argument("topic")
    send.add_argument("body", nargs="+", help="message bodies; '-' reads one per stdin line")
    send.add_argument("--key")
    send.add_argument("--tags")
    send.add_argument("--delay-level", type=int, default=0)
    send.add_argument("--deliver-at", type=_when_ms, metavar="WHEN",
                      help="deliver at this time: epoch ms, an ISO time, or +DURATION "
                           "(e.g. +90s, +10m, +2h, +3d)")
    send.add_argument("--deliver-after-ms", type=int, metavar="MS",
                      help="deliver this many ms after the shard stores it")
    send.add_argument("--repeat", type=_positive_int, default=1,
                      help="send each body this many times")
    send.add_argument("--group", default="cli", help="producer group")
    send.set_defaults(func=_cmd_send)

    consume = sub.add_parser("consume", help="consume and print messages")
    consume.add_argument("topic")
    consume.add_argument("--group", required=True)
    consume.add_argument("--tags", help="tag filter, e.g. 'paid || refunded'")
    consume.add_argument("--max", type=_positive_int, default=100, help="stop after this many")
    consume.add_argument("--timeout", type=float, default=5.0,
                         help="stop after this many seconds without a message")
    consume.add_argument("--no-commit", action="store_true", help="do not commit offsets")
    consume.set_defaults(func=_cmd_consume)

    group = sub.add_parser("group", help="consumer groups' committed offsets")
    gsub = group.add_subparsers(dest="group_cmd", required=True, metavar="ACTION")
    gr = gsub.add_parser(
        "reset-offsets", help="move a group's committed offsets on a topic's queues (refused "
        "while the group has live members, as Kafka does)")
    gr.add_argument("group")
    gr.add_argument("--topic", required=True)
    to = gr.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="each queue's log start")
    to.add_argument("--to-latest", action="store_true", help="each queue's end")
    to.add_argument("--to-datetime", metavar="ISO", help="the first message stored at or "
                    "after this time, e.g. 2026-11-27T18:00:00 (UTC unless it says otherwise)")
    to.add_argument("--by-duration", type=duration_ms, metavar="DURATION",
                    help="the first message stored this long ago or later, e.g. 1h")
    to.add_argument("--to-offset", type=int, metavar="N", help="this offset in every queue "
                    "(kept between the log start and the end)")
    gr.add_argument("--dry-run", action="store_true", help="show the new offsets, change "
                    "nothing")
    group.set_defaults(func=_cmd_group)

    dlq = sub.add_parser("dlq", help="dead letters of a consumer group")
    dsub = dlq.add_subparsers(dest="dlq_cmd", required=True, metavar="ACTION")
    dl = dsub.add_parser("list", help="list dead letters")
    dl.add_argument("group")
    dr = dsub.add_parser("resend", help="redeliver dead letters (all not resent yet, or IDS)")
    dr.add_argument("group")
    dr.add_argument("ids", nargs="*", help="dead-letter ids as printed by `dlq list`")
    dlq.set_defaults(func=_cmd_dlq)

    msg = sub.add_parser("msg", help="look messages up without consuming")
    msub = msg.add_subparsers(dest="msg_cmd", required=True, metavar="ACTION")
    ms = msub.add_parser("show", help="a message by id")
    ms.add_argument("id")
    mf = msub.add_parser("find", help="messages of a topic with a key")
    mf.add_argument("topic")
    mf.add_argument("key")
    msg.set_defaults(func=_cmd_msg)

    half = sub.add_parser("half", help="pending transactional half messages")
    hsub = half.add_subparsers(dest="half_cmd", required=True, metavar="ACTION")
    hl = hsub.add_parser("list", help="list pending halves (age, group, check count)")
    hl.add_argument("--expired", action="store_true",
                    help="list halves that reached the maximum number of checks")
    for action in ("commit", "rollback"):
        ha = hsub.add_parser(action, help=f"{action} a pending or expired half (operator)")
        ha.add_argument("id", help="half id as printed by `half list`")
    half.set_defaults(func=_cmd_half)

    tx = sub.add_parser("tx", help="Kafka-style transactions (KIP-664 operations)",
                        description="Kafka-style transactions (KIP-664): the transactional "
                                    "ids every coordinator knows, and the open transactions "
                                    "holding back a queue's last stable offset (LSO), where "
                                    "read_committed readers stop.")
    tsub = tx.add_subparsers(dest="tx_cmd", required=True, metavar="ACTION")
    tsub.add_parser("list", help="every transactional id: state, epoch, age, queues",
                    description="One line per transactional id on every coordinator: id, "
                                "state (EMPTY, ONGOING, PREPARE_COMMIT, COMPLETE_COMMIT, ...), "
                                "producer id, epoch, the open transaction's age and its "
                                "queues (topic/queue); the count on stderr.")
    td = tsub.add_parser("describe", help="one transactional id in full (JSON)",
                         description="One transactional id as JSON: producer id, epoch, state, "
                                     "timeout_ms, age_ms, queues [shard, topic, queue] and "
                                     "groups whose offsets the transaction commits.")
    td.add_argument("id", help="transactional id")
    ta = tsub.add_parser("abort", help="abort a transactional id's open transaction "
                                       "(operator): markers written, its data never visible",
                         description="Abort the open transaction of ID: its coordinator logs "
                                     "PREPARE_ABORT and writes abort markers in its queues, so "
                                     "read_committed readers never see its messages and the "
                                     "queues' LSO moves on; prints the final state. The "
                                     "producer's next commit raises TransactionAbortedError.")
    ta.add_argument("id", help="transactional id")
    tsub.add_parser("hanging", help="open transactions holding back a queue's last stable "
                                    "offset, the furthest behind first",
                    description="Every queue whose LSO an open transaction holds back: queue, "
                                "shard, LSO, end, records behind, the transaction's age, id, "
                                "state and producer id; the furthest behind first. `raymq tx "
                                "abort ID` ends one that is stuck.")
    tx.set_defaults(func=_cmd_tx)

    timer = sub.add_parser("timer", help="scheduled messages (deliver_at_ms / deliver_after_ms)")
    tisub = timer.add_subparsers(dest="timer_cmd", required=True, metavar="ACTION")
    tl = tisub.add_parser("list", help="timer messages not yet delivered, soonest first")
    tl.add_argument("--due-before", type=_when_ms, default="+1h", metavar="WHEN",
                    help="only those due before WHEN: epoch ms, an ISO time (UTC unless it "
                         "says), or +DURATION from now (+90s, +10m, +2h, +3d)")
    tl.add_argument("--limit", type=_positive_int, default=100, help="most to list")
    tc_ = tisub.add_parser("cancel", help="cancel a delayed or timer message before it is "
                                          "delivered (the id its send printed)")
    tc_.add_argument("id", help="message id")
    timer.set_defaults(func=_cmd_timer)

    job = sub.add_parser("job", help="Spark jobs over committed messages (RayDP)")
    jsub = job.add_subparsers(dest="job_cmd", required=True, metavar="JOB")
    oi = jsub.add_parser("order-income", help="income per minute and shop from the orders "
                                              "topic to the income topic, exactly once")
    when = oi.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="one run, then exit (the default)")
    when.add_argument("--every", type=float, metavar="SECONDS",
                      help="a run every SECONDS until interrupted")
    oi.add_argument("--source", default="orders", help="topic of the orders")
    oi.add_argument("--target", default="income", help="topic the income goes to")
    oi.add_argument("--group", default="order-income",
                    help="the job's group: its committed input offsets")
    job.set_defaults(func=_cmd_job)

    demo = sub.add_parser("demo", help="run the main demonstration",
                          description="The seeds' shopping scenario on an embedded local "
                                      "cluster: an order service (SQLite + transactional "
                                      "messages) and a points service, with a producer killed "
                                      "after its DB commit, lost end_transactions, failing "
                                      "local transactions and failing consumers; then a "
                                      "consistency report. Exit status 1 when inconsistent.")
    demo.add_argument("--data-dir", help="where to keep the demo's data (default: a new "
                                         "temporary directory)")
    demo.add_argument("--orders", type=int, default=60, help="orders to place (default 60)")
    demo.add_argument("--storage", action="store_true",
                      help="run the storage-engine crash demonstration instead")
    demo.add_argument("--sabotage", choices=("check-always-commits",),
                      help="break the order service on purpose (its check-back answers COMMIT "
                           "without looking at its database) to see the consistency report "
                           "catch it: the demo then exits 1")
    demo.add_argument("--no-spark", action="store_true",
                      help="leave out the order-income Spark job (RayDP) and its report line "
                           "(income per minute from Spark = the order database's totals)")
    demo.add_argument("--verbose", dest="demo_verbose", action="store_true",
                      help="show Ray's, Spark's and RayMQ's own logs as they come (by default "
                           "only the demo's lines, and anything that went wrong)")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="run benchmarks (JSON lines on stdout)",
                           description="Run benchmark suites. Each result is one JSON object "
                                       "per line on stdout: metric, value, unit, params. "
                                       "Figures with a baseline come with the baseline "
                                       "measured in the same run and their ratio.")
    from raymq.tools.suites import LONG_SUITES, SUITES
    bench.add_argument("suites", nargs="*", metavar="SUITE",
                       help=f"suites to run: {', '.join(SUITES)} (default: all but the long "
                            f"ones, which run only when named: {', '.join(sorted(LONG_SUITES))})")
    bench.add_argument("--scale", type=float, default=1.0,
                       help="multiply the message counts (e.g. 0.1 for a quick run)")
    bench.add_argument("--workdir", help="directory for benchmark data (default: system temp)")
    bench.set_defaults(func=_cmd_bench)

    console = sub.add_parser(
        "console", help="serve the web console for operators",
        description="Serve RayMQ's web console for the cluster this command joins (found as "
                    "every command finds it): overview, topics, message look-up, half "
                    "messages, Kafka-style transactions, timers, consumer groups and dead "
                    "letters, each page also JSON under /api/. Prints the URL and, unless "
                    "--read-only, the access token every action needs.")
    console.add_argument("--host", default="127.0.0.1",
                         help="address to listen on (127.0.0.1: this machine only)")
    console.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    console.add_argument("--read-only", action="store_true",
                         help="refuse every action (no token is made)")
    console.add_argument("--sample-every", type=float, default=5.0, metavar="S",
                         help="seconds between the samples the charts draw")
    console.add_argument("--embedded", action="store_true",
                         help="start a local Ray and RayMQ of its own over the settings of "
                              "--config (e.g. the data a `raymq demo` left) instead of joining "
                              "a running cluster")
    console.set_defaults(func=_cmd_console)

    kafka = sub.add_parser(
        "kafka", help="serve a Kafka-protocol listener for Kafka clients",
        description="Serve Kafka's wire protocol for the cluster this command joins (found as "
                    "every command finds it): Kafka clients (kafka-python, librdkafka, the Java "
                    "client) bootstrap from the printed address and produce, fetch, list "
                    "topics and offsets, and consume in groups. A topic is a topic, a partition is a queue, an offset "
                    "a queue offset; system, retry and dead-letter topics are not listed. "
                    "Consumer groups and idempotent producers are served; transactional "
                    "producers and the admin APIs not yet.")
    kafka.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (127.0.0.1: this machine only)")
    kafka.add_argument("--port", type=int, default=9092, help="port (0: any free one)")
    kafka.add_argument("--advertised-host", default=None, metavar="HOST",
                       help="the host clients are told to connect to (unset: --host)")
    kafka.add_argument("--embedded", action="store_true",
                       help="start a local Ray and RayMQ of its own over the settings of "
                            "--config instead of joining a running cluster")
    kafka.set_defaults(func=_cmd_kafka)

    config = sub.add_parser(
        "config", help="describe the cluster settings, or check a settings file",
        description="The cluster's settings (raymq.actors.config.ClusterConfig) are the keys "
                    "of a JSON object: `raymq --config FILE up`, or connect(config={...}). "
                    "--describe prints every setting: its type and constraint (e.g. int >= 1), "
                    "its default (as JSON) and what it does, then the rules across settings. "
                    "Without --describe: the settings of --config FILE (defaults filled in) as "
                    "JSON, after checking them (what a first deploy would use); an unknown key or "
                    "a bad value is one CONFIG_INVALID line naming the setting (exit status 1). "
                    "Needs no Ray cluster.")
    config.add_argument("--describe", action="store_true",
                        help="every setting with its type/constraint, default and doc")
    config.set_defaults(func=_cmd_config)

    from raymq.tools import storage_repair  # raymq storage cut (offline, no Ray)
    storage_repair.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from raymq.storage.errors import RayMQError
    try:
        return args.func(args)
    except RayMQError as err:
        print(f"raymq: {err.code}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("raymq: interrupted", file=sys.stderr)
        return 130
    except OSError as err:  # e.g. a --config file that cannot be read
        where = f" {err.filename}" if err.filename else ""
        print(f"raymq: {err.strerror or err}:{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
