// kafkajs (Node.js; a Kafka client none of ours) against a RayMQ Kafka listener: an
// idempotent producer with binary keys and repeated headers, a consumer group that reads
// and commits, and a transactional copy with the group's offsets in the transaction
// (then an aborted transaction).  Prints one JSON line of what it saw; exits non-zero
// on any error.  Usage: node scenario.js HOST:PORT SOURCE_TOPIC DEST_TOPIC GROUP COUNT
"use strict";
const { Kafka, logLevel } = require("kafkajs");

const [broker, src, dst, group, countText] = process.argv.slice(2);
const count = Number(countText);
const kafka = new Kafka({ clientId: "raymq-test", brokers: [broker], logLevel: logLevel.NOTHING,
                          retry: { retries: 8 } });

async function produce() {
  const p = kafka.producer({ idempotent: true, maxInFlightRequests: 1 });
  await p.connect();
  const messages = [];
  for (let i = 0; i < count; i++) {
    messages.push({ key: Buffer.from([0xff, i]), value: Buffer.from(`js ${i}`),
                    headers: { h: [Buffer.from(`${i}`), Buffer.from("again")] } });
  }
  const sent = await p.send({ topic: src, messages, acks: -1 });
  await p.disconnect();
  return sent.map((r) => ({ partition: r.partition, base: Number(r.baseOffset) }));
}

async function consume() {
  const c = kafka.consumer({ groupId: group, sessionTimeout: 10000, heartbeatInterval: 1000 });
  await c.connect();
  await c.subscribe({ topic: src, fromBeginning: true });
  const seen = [];
  const ends = {};
  await new Promise((resolve, reject) => {
    c.run({
      autoCommit: false,
      eachMessage: async ({ partition, message }) => {
        seen.push({ partition, offset: Number(message.offset), key: [...message.key],
                    value: message.value.toString(),
                    headers: message.headers.h.map((b) => b.toString()) });
        ends[partition] = Number(message.offset) + 1;
        await c.commitOffsets([{ topic: src, partition, offset: `${ends[partition]}` }]);
        if (seen.length === count) resolve();
      },
    }).catch(reject);
  });
  await c.disconnect();
  return { seen, ends };
}

async function copy(seen, ends) {
  const p = kafka.producer({ transactionalId: `${group}-tx`, idempotent: true,
                             maxInFlightRequests: 1 });
  await p.connect();
  const txn = await p.transaction();
  await txn.send({ topic: dst, messages: seen.map((m) => ({ key: Buffer.from(m.key),
                                                            value: m.value.toUpperCase() })) });
  await txn.sendOffsets({ consumerGroupId: `${group}-copier`, topics: [{ topic: src,
    partitions: Object.entries(ends).map(([partition, offset]) => ({
      partition: Number(partition), offset: `${offset}` })) }] });
  await txn.commit();
  const aborted = await p.transaction();
  await aborted.send({ topic: dst, messages: [{ value: "aborted" }] });
  await aborted.abort();
  await p.disconnect();
}

(async () => {
  const sent = await produce();
  const { seen, ends } = await consume();
  await copy(seen, ends);
  process.stdout.write(JSON.stringify({ sent, seen, ends }) + "\n");
})().catch((err) => {
  process.stderr.write(`kafkajs scenario failed: ${err && err.stack || err}\n`);
  process.exit(1);
});
