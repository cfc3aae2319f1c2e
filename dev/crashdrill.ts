#!/usr/bin/env bun
/**
 * dev/crashdrill.ts: kills a real bus with SIGKILL at random moments under load and checks its promises
 * (docs/durability.md): a message answered 202 is never lost, and once its ack is answered it is never handed out
 * again. Prints one JSON report on stdout, progress on stderr; exits 1 if anything was lost or shown after its ack.
 *
 *   bun dev/crashdrill.ts [--bus-runtime bun|deno] [--kills N] [--senders N]
 *
 * Several senders post signed messages, each to its own route (odd ones in batches, as a node's outbox does), and a
 * reader per route receives in batches with recv proofs and acks them; meanwhile the bus (`interlink.ts bus --port P
 * --data DIR`) is killed and restarted on the same folder and port. A send without an answer is never retried as the
 * same message (a new one takes the next number), so a msg_id seen twice is a redelivery, not a resend.
 */

import type { Buffer } from "node:buffer";
import { type ChildProcess, spawn } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { identityFromSeed, recvProofBytes, type SignedMessage, signMessage, sleep } from "../interlink.ts";

const USAGE = `Usage: bun dev/crashdrill.ts [options]
       deno run -A dev/crashdrill.ts [options]

Starts a bus on a loopback port, has senders post signed messages (odd ones in batches) and a reader per route
receive and ack them (lagging now and then), and kills the bus with SIGKILL at random moments (one kill in five within
300 ms of its spawn), restarting it on the same folder each time. Then it drains every route, kills it once more and
looks again. Counts: lost (answered 202, never received), shown again after its ack was answered, out of order per
route, handed again before an ack.

Options:
  --bus-runtime bun|deno  the bus's runtime (default: this one's)
  --kills N               SIGKILLs (default 20)
  --senders N             senders, one route each (default 4)
  --up-ms N               a started bus lives up to N ms before its kill; a lagging reader pauses up to N ms
                          (default 1500)
  --keep                  keep the temporary folder (the bus's data and its stderr)
  -h, --help              show this help`;

const { values: o } = parseArgs({
  options: {
    "bus-runtime": { type: "string" },
    kills: { type: "string", default: "20" },
    senders: { type: "string", default: "4" },
    "up-ms": { type: "string", default: "1500" },
    keep: { type: "boolean", default: false },
    help: { type: "boolean", short: "h", default: false },
  },
});
if (o.help) {
  console.log(USAGE);
  process.exit(0);
}
const own = "Deno" in globalThis ? "deno" : "bun";
const runtime = o["bus-runtime"] ?? own;
const [kills, senders, upMs] = [Number(o.kills), Number(o.senders), Number(o["up-ms"])];
if (!["bun", "deno"].includes(runtime) || ![kills, senders, upMs].every((n) => Number.isInteger(n) && n > 0)) {
  console.error(`crashdrill: bad options\n\n${USAGE}`);
  process.exit(2);
}

const INTERLINK = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "interlink.ts");
const root = fs.mkdtempSync(path.join(os.tmpdir(), "interlink-crashdrill-"));
const dataDir = path.join(root, "bus");
const progress = (m: string) => process.stderr.write(`crashdrill: ${m}\n`);
const random = (n: number) => Math.floor(Math.random() * n);

/** A free loopback port, kept by every bus of the drill. */
const port = await new Promise<number>((resolve) => {
  const s = net.createServer().listen(0, "127.0.0.1", () => {
    const p = (s.address() as net.AddressInfo).port;
    s.close(() => resolve(p));
  });
});
const url = `http://127.0.0.1:${port}`;
const busLog = fs.openSync(path.join(root, "bus-stderr.log"), "a");

/** Spawns the bus; `listening` resolves once it says so, rejects if it exits first. */
function spawnBus(): { child: ChildProcess; listening: Promise<void>; exited: Promise<void> } {
  const args = [INTERLINK, "bus", "--port", String(port), "--data", dataDir];
  const [cmd, argv] = runtime === "deno"
    ? [own === "deno" ? process.execPath : "deno", ["run", "-A", "--quiet", ...args]]
    : [own === "bun" ? process.execPath : "bun", args];
  const child = spawn(cmd, argv, { stdio: ["ignore", "ignore", "pipe"] });
  const exited = new Promise<void>((r) => child.once("exit", () => r()));
  const listening = new Promise<void>((resolve, reject) => {
    child.stderr!.on("data", (d: Buffer) => {
      fs.writeSync(busLog, d);
      if (d.toString().includes("listening on")) resolve();
    });
    void exited.then(() => reject(new Error(`the bus exited (${child.exitCode ?? child.signalCode}); see ${root}`)));
  });
  listening.catch(() => {});
  return { child, listening, exited };
}

async function kill9(bus: ReturnType<typeof spawnBus>): Promise<void> {
  bus.child.kill("SIGKILL");
  await bus.exited;
}

// -- what every side saw --------------------------------------------------------

const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
const routes = Array.from({ length: senders }, (_, i) => `${id.publicKey}#drill-${i}`);
const numberOf = new Map<string, number>(), routeOf = new Map<string, string>(); // msg_id → its number, its route
const answered202 = new Set<string>();
const received = new Set<string>();
const ackAnswered = new Set<string>();
const count = { sent: 0, unanswered: 0, redelivered: 0, shownAfterAck: 0, outOfOrder: 0 };
const refusedBy: Record<number, number> = {}; // HTTP status → messages refused with it (429: a full route)
const shownAfterAck: string[] = [], outOfOrder: string[] = [];
const highest = new Map<string, number>(); // per route, the highest number received
let sending = true, reading = true;

const post = (route: string, body: unknown) =>
  fetch(`${url}${route}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(10_000),
  });

async function sender(i: number): Promise<void> {
  const route = routes[i];
  for (let n = 0; sending;) {
    const batch: SignedMessage[] = [];
    for (let k = i % 2 ? 1 + random(8) : 1; k > 0; k--) {
      const m = await signMessage(id, { to: id.publicKey, text: `${i}:${n}` }, Date.now());
      numberOf.set(m.msg_id, n++);
      routeOf.set(m.msg_id, route);
      batch.push(m);
    }
    count.sent += batch.length;
    try {
      const body = i % 2
        ? { messages: batch.map((m) => ({ to: route, payload: m })) }
        : { to: route, payload: batch[0] };
      const r = await post("/send", body);
      const results: { status: number }[] = i % 2 && r.ok
        ? (await r.json()).results
        : batch.map(() => ({ status: r.status }));
      if (!(i % 2) || !r.ok) await r.body?.cancel();
      batch.forEach((m, k) => {
        const status = results[k]?.status;
        if (status === 202) answered202.add(m.msg_id);
        else if (status === undefined) count.unanswered++;
        else refusedBy[status] = (refusedBy[status] ?? 0) + 1;
      });
      if (results.some((x) => x.status !== 202)) await sleep(50);
    } catch {
      count.unanswered += batch.length; // no answer: the bus died under it, or was not up
      await sleep(20);
    }
  }
}

async function proof(route: string): Promise<string> {
  const ts = Date.now();
  return `${ts}.${await id.sign(recvProofBytes(route, ts))}`;
}

/** One recv of `route` and, if anything came, its ack; false if the bus had nothing (or did not answer). */
async function readOnce(route: string, waitMs: number): Promise<boolean> {
  let batch: { envelope: { payload: SignedMessage }; ack: string }[];
  try {
    const q = `me=${encodeURIComponent(route)}&timeout_ms=${waitMs}&max=16&proof=${await proof(route)}`;
    const r = await fetch(`${url}/recv?${q}`, { signal: AbortSignal.timeout(waitMs + 10_000) });
    const body = await r.json();
    if (body.status === "timeout") return false;
    batch = body.status === "messages" ? body.messages : [body];
  } catch {
    await sleep(20);
    return false;
  }
  for (const { envelope: { payload: m } } of batch) {
    const n = numberOf.get(m.msg_id)!;
    if (ackAnswered.has(m.msg_id)) {
      count.shownAfterAck++;
      shownAfterAck.push(`${route.slice(-8)} n=${n}`);
    } else if (received.has(m.msg_id)) count.redelivered++; // never acked: handing it out again is allowed
    else {
      if (n < (highest.get(route) ?? -1)) {
        count.outOfOrder++;
        outOfOrder.push(`${route.slice(-8)} n=${n} after ${highest.get(route)}`);
      }
      highest.set(route, Math.max(n, highest.get(route) ?? -1));
      received.add(m.msg_id);
    }
  }
  try {
    const r = await post("/ack", { me: route, acks: batch.map((x) => x.ack), proof: await proof(route) });
    await r.body?.cancel();
    if (r.ok) { for (const x of batch) ackAnswered.add(x.envelope.payload.msg_id); }
  } catch {
    // no answer: not acked as far as we know, so it may come again
  }
  return true;
}
async function reader(route: string): Promise<void> {
  while (reading) {
    if (random(20) === 0) await sleep(random(upMs)); // now and then it lags: a kill finds a backlog to recover
    await readOnce(route, 500);
  }
}

// -- the drill --------------------------------------------------------------------

const t0 = performance.now();
progress(`${runtime} bus on ${url}, data in ${dataDir}; ${senders} senders, ${kills} kills`);
const load = [...routes.map((_, i) => sender(i)), ...routes.map(reader)];
let bus = spawnBus();
try {
  for (let k = 1; k <= kills; k++) {
    if (k % 5 === 0) await sleep(random(300)); // during its start: opening, recovering
    else {
      await bus.listening;
      await sleep(random(upMs));
    }
    await kill9(bus);
    progress(
      `kill ${k}/${kills}: ${answered202.size} answered 202, ${received.size} received, ${ackAnswered.size} acked`,
    );
    await sleep(random(200));
    bus = spawnBus();
  }
  await bus.listening;
  sending = false;
  await sleep(1000);
  // Drain: every route read until the bus has nothing, twice in a row.
  const idle = async (route: string) => {
    for (let empty = 0; empty < 2;) empty = (await readOnce(route, 1000)) ? 0 : empty + 1;
  };
  reading = false;
  await Promise.all(load);
  await Promise.all(routes.map(idle));
  // One more kill, and the routes read again: nothing acked may come back.
  await kill9(bus);
  bus = spawnBus();
  await bus.listening;
  await Promise.all(routes.map(idle));
} finally {
  await kill9(bus);
}

const lost = [...answered202].filter((m) => !received.has(m));
const report = {
  bus_runtime: runtime,
  kills,
  senders,
  seconds: Math.round((performance.now() - t0) / 100) / 10,
  sent: count.sent,
  answered_202: answered202.size,
  refused: refusedBy,
  unanswered: count.unanswered,
  received: received.size,
  received_without_202: [...received].filter((m) => !answered202.has(m)).length,
  acks_answered: ackAnswered.size,
  lost: lost.length,
  shown_after_ack: count.shownAfterAck,
  out_of_order: count.outOfOrder,
  redelivered_before_ack: count.redelivered,
  examples: {
    lost: lost.slice(0, 5).map((m) => `route ${routes.findIndex((r) => r === routeOf.get(m))} n=${numberOf.get(m)}`),
    shown_after_ack: shownAfterAck.slice(0, 5),
    out_of_order: outOfOrder.slice(0, 5),
  },
};
console.log(JSON.stringify(report, null, 2));
if (o.keep) progress(`kept ${root}`);
else fs.rmSync(root, { recursive: true, force: true });
process.exit(lost.length || count.shownAfterAck ? 1 : 0);
