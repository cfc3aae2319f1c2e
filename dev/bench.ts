#!/usr/bin/env bun
/**
 * dev/bench.ts: measures interlink's bus and agents and prints the figures as
 * one JSON object on stdout, progress on stderr. Dev only: it lives in the
 * repository beside interlink.ts and imports it; nobody who copies
 * interlink.ts gets it, or needs it.
 *
 *   bun dev/bench.ts [--only LIST] [--bus-runtime bun|deno] [--messages N]
 *   deno run -A dev/bench.ts [--only LIST] [--bus-runtime bun|deno] [--messages N]
 *
 * Every server measured (our bus, the in-memory floor, redis-server,
 * nats-server) is a child process on a loopback port, so the CPU and RSS
 * figures are its own; the load and the agents run in this process's
 * runtime. redis-server and nats-server are optional: without them, their
 * legs say "skipped" and how to install them. The footprint part runs
 * `mcp` and `wait` under both runtimes (the other one from PATH, else the
 * pinned npm package through npx), and claude-peers-mcp beside them when
 * CLAUDE_PEERS_DIR names a checkout of it.
 *
 * Sections: options and usage, reading a process, the servers, the loads, the
 * parts of a run, main.
 */

import { Buffer } from "node:buffer";
import { spawn, spawnSync } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import {
  addPeer,
  ANNOUNCE_EVERY_MS,
  decide,
  HttpRelay,
  type Identity,
  identityFromSeed,
  InterlinkError,
  Journal,
  JsonlWriter,
  type NewRecord,
  NodeState,
  postJson,
  print,
  QUEUE_CAP,
  readRoster,
  RECV_BATCH,
  RECV_TIMEOUT_MS,
  recvProofBytes,
  type Relay,
  ReplayMemory,
  ROSTER_CAP,
  runtimeName,
  sealMessage,
  selfCommand,
  SEND_TIMEOUT_MS,
  shutdownSignal,
  signAnnouncement,
  type SignedMessage,
  signMessage,
  sleep,
  thisScript,
  utf8Bytes,
  VERSION,
  withFileLock,
  writeKeyFile,
} from "../interlink.ts";
import { NatsRelay } from "../nats.ts";
import { errorResponse, jsonResponse, SENDER_BYTES_MAX, serveHttp, splitUrl, TOTAL_BYTES_MAX } from "../bus.ts";
import { childEnv, McpSession, startChild, startDemoNode, stopChild } from "./harness.ts";

// ============================================================================
// Options and usage
// ============================================================================

/** The parts of a run, in the order they run; `--only` picks some. */
export const PARTS = [
  "throughput",
  "recovery",
  "idle",
  "agents",
  "sessions",
  "idle-sessions",
  "flood",
  "relays",
  "footprint",
  "backlog",
  "seal",
] as const;
type Part = (typeof PARTS)[number];
type Runtime = "bun" | "deno";
/** The footprint part's day of use: messages from one agent to another (--messages). */
const DAY_MESSAGES = 10_000;
/** The backlog part: messages queued unsent in one session's outbox while its relay is down (--backlog). */
const BACKLOG_MESSAGES = 50_000;

/** bench.ts's flags, for node:util parseArgs and for the usage text (which lists every one). */
export const OPTIONS: Record<string, { type: "string" | "boolean"; short?: string; arg?: string; help: string }> = {
  only: {
    type: "string",
    arg: "LIST",
    help: `comma-separated subset of ${PARTS.join(", ")} (our bus beside NATS); default: all of them`,
  },
  "bus-runtime": {
    type: "string",
    arg: "bun|deno",
    help:
      "run the bus and the floor under this runtime (from PATH), the load generator staying where bench.ts runs: Bun, for figures comparable across runtimes",
  },
  messages: {
    type: "string",
    arg: "N",
    help: "messages in the footprint part's day of use (default 10000)",
  },
  backlog: {
    type: "string",
    arg: "N",
    help: `messages queued unsent in the backlog part (default ${BACKLOG_MESSAGES})`,
  },
  "serve-floor": {
    type: "boolean",
    help: "only serve the in-memory floor the throughput figures are compared with (bench.ts starts it itself)",
  },
  help: { type: "boolean", short: "h", help: "show this help" },
};

const USAGE = [
  "Usage: bun dev/bench.ts [options]",
  "       deno run -A dev/bench.ts [options]",
  "",
  "Measure the bus and the agents and print the figures as JSON (progress on stderr).",
  "",
  "throughput: 8 pairs × 500 messages (then 64 × 125) through send → recv → ack on a durable bus, also",
  "batched, beside the in-memory floor (same routes, no disk, no checks) and Redis with appendfsync always (if",
  "redis-server is on PATH) in the same run, each as a ratio to them; recovery: restart on 100,000 un-acked",
  "messages to the first recv, and RSS after; idle: 500 waiting long-polls, RSS and CPU; agents: cold start to the",
  "first tools/list, send → push latency p50/p99 over 200 messages, idle RSS; sessions: 10 sessions of each of two",
  "keys exchanging 200 messages each (misrouted, lost, duplicated); idle-sessions: 10, 50 and 100 idle `mcp` sessions",
  "on one bus, all of one node, then each its own node (same run), CPU per session over a minute and the bus's, one",
  "node's as a ratio to one node each's; flood: 50,000 keys announce, roster size and",
  "bus RSS; relays: our bus beside a NATS JetStream server (needs nats-server on PATH); footprint: bare Bun and",
  "Deno, then `mcp` and `wait` under each (spawn to first tools/list or to blocking, RSS, idle CPU, as ratios to the",
  "bare runtime), wait's wake latency beside channel push, claude-peers-mcp (if CLAUDE_PEERS_DIR names a checkout),",
  "and a day of use: --messages between two agents, their RSS after, the receiver's restart on its journal, and",
  "`wait` on that journal beside a fresh one; backlog: a session whose relay is down gets --backlog messages",
  "queued (as `interlink.ts send` queues them), its RSS beside the same session fresh, restarted on that journal,",
  "then the relay comes back and the backlog drains to a live peer (lost, duplicated, out of order, peak RSS);",
  "seal: send → push p50/p99 of 200 messages sealed (to a peer that opens them) beside 200 plain (to one taken as",
  "opening none), interleaved in one run, and their ratio; then sealing and opening alone beside signing and verifying.",
  "",
  "Options:",
  ...(() => {
    const rows = Object.entries(OPTIONS).map(([flag, o]) => [
      `${o.short ? `-${o.short}, ` : ""}--${flag}${o.arg ? ` ${o.arg}` : ""}`,
      o.help,
    ]);
    const width = Math.max(...rows.map(([l]) => l.length));
    return rows.map(([l, r]) => `  ${l.padEnd(width)}  ${r}`);
  })(),
].join("\n");

interface BenchOptions {
  help: boolean;
  serveFloor: boolean;
  parts: Part[];
  /** The runtime the bus and the floor run under (--bus-runtime); undefined: this one. */
  servers: Runtime | undefined;
  /** Messages in the footprint part's day of use (--messages). */
  messages: number;
  /** Messages queued unsent in the backlog part (--backlog). */
  backlog: number;
}

/** argv as BenchOptions; an unknown flag or part, or a runtime other than bun and deno, is an InterlinkError. */
export function parseOptions(argv: string[]): BenchOptions {
  let values: Record<string, string | boolean | undefined>;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: Object.fromEntries(
        Object.entries(OPTIONS).map(([flag, o]) => [flag, { type: o.type, ...(o.short ? { short: o.short } : {}) }]),
      ),
      strict: true,
      allowPositionals: false,
    }));
  } catch (e) {
    throw new InterlinkError(`${(e as Error).message.replace(/\. To specify.*$/s, "")}\n\n${USAGE}`);
  }
  const parts = String(values.only ?? PARTS.join(",")).split(",").map((x) => x.trim());
  for (const x of parts) {
    if (!(PARTS as readonly string[]).includes(x)) {
      throw new InterlinkError(`unknown benchmark '${x}'; choose from ${PARTS.join(", ")}`);
    }
  }
  const servers = values["bus-runtime"];
  if (servers !== undefined && servers !== "bun" && servers !== "deno") {
    throw new InterlinkError("--bus-runtime is bun or deno");
  }
  const messages = values.messages === undefined ? DAY_MESSAGES : Number(values.messages);
  if (!Number.isSafeInteger(messages) || messages < 1) throw new InterlinkError("--messages is a whole number above 0");
  const backlog = values.backlog === undefined ? BACKLOG_MESSAGES : Number(values.backlog);
  if (!Number.isSafeInteger(backlog) || backlog < 1) throw new InterlinkError("--backlog is a whole number above 0");
  return {
    help: values.help === true,
    serveFloor: values["serve-floor"] === true,
    parts: parts as Part[],
    servers,
    messages,
    backlog,
  };
}

// ============================================================================
// Reading a process (Linux /proc)
// ============================================================================

/** Resident set size of a process in MB (Linux /proc; null elsewhere). */
function rssMb(pid: number): number | null {
  try {
    const kb = Number(fs.readFileSync(`/proc/${pid}/status`, "utf8").match(/VmRSS:\s+(\d+)/)![1]);
    return Math.round(kb / 102.4) / 10;
  } catch {
    return null;
  }
}

/** CPU seconds a process has used (user + system; Linux /proc, 100 ticks per second). */
function cpuSeconds(pid: number): number | null {
  try {
    const fields = fs.readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].split(" ");
    return (Number(fields[11]) + Number(fields[12])) / 100;
  } catch {
    return null;
  }
}

/**
 * CPU time of a process's main thread in ns (Linux /proc schedstat; null elsewhere): finer than cpuSeconds's
 * 10 ms ticks, to tell when a process has stopped running.
 */
function mainThreadCpuNs(pid: number): number | null {
  try {
    return Number(fs.readFileSync(`/proc/${pid}/task/${pid}/schedstat`, "utf8").split(" ")[0]);
  } catch {
    return null;
  }
}

/** CPU percent of a process over `ms`, from two cpuSeconds readings; null without /proc. */
function cpuPercent(cpu0: number | null, cpu1: number | null, ms: number): number | null {
  return cpu0 === null || cpu1 === null ? null : Math.round(((cpu1 - cpu0) / (ms / 1000)) * 1000) / 10;
}

/** The middle value (of 3: the second smallest); nulls (no /proc) left out. */
function median(values: (number | null)[]): number | null {
  const sorted = values.filter((v): v is number => v !== null).sort((x, y) => x - y);
  return sorted.length ? sorted[Math.floor(sorted.length / 2)] : null;
}

/** a / b to two decimals; null when either is unknown. */
function ratio(a: number | null, b: number | null): number | null {
  return a === null || b === null || b === 0 ? null : Math.round((a / b) * 100) / 100;
}

const loadAverage = () => os.loadavg().map((n) => Math.round(n * 100) / 100);

function percentile(sorted: number[], p: number): number {
  return Math.round(sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] * 10) / 10;
}

// ============================================================================
// The servers
// ============================================================================
//
// Our bus runs as `interlink.ts bus`, the floor as `bench.ts --serve-floor`,
// each under --bus-runtime when it is given; interlink.ts's startChild waits
// for their "listening on" line.

const INTERLINK = thisScript();
const BENCH = fileURLToPath(import.meta.url);
const OWN_RUNTIME: Runtime = runtimeName().startsWith("deno") ? "deno" : "bun";

/**
 * argv that runs `script` with `args` under `runtime`: this one as interlink.ts runs its own children; the other
 * from PATH, a Deno bus with --optimize-for-size as interlink starts one.
 */
function serverCommand(runtime: Runtime | undefined, script: string, args: string[]): string[] {
  if (runtime === undefined || runtime === OWN_RUNTIME) return selfCommand(args, script);
  const exe = findOnPath(runtime);
  if (!exe) {
    throw new InterlinkError(
      `${runtime} is not on PATH (it runs with npx -y ${runtime}@${runtime === "deno" ? "2.9.6" : "1.4.5"})`,
    );
  }
  return runtime === "deno"
    ? [exe, "run", "-A", "--quiet", ...(args[0] === "bus" ? ["--v8-flags=--optimize-for-size"] : []), script, ...args]
    : [exe, script, ...args];
}

/** The versions the README and CI run, which npx fetches when a runtime is not on PATH. */
const PINNED: Record<Runtime, string> = { bun: "1.4.5", deno: "2.9.6" };
const binaries = new Map<Runtime, string>();

/**
 * The executable of `runtime`: this process's own, else one on PATH, else the pinned npm package's through npx (as
 * interlink.test.ts finds Deno), so the footprint part measures both runtimes where only one is installed.
 */
function runtimeBinary(runtime: Runtime): string {
  let exe = binaries.get(runtime) ?? (runtime === OWN_RUNTIME ? process.execPath : findOnPath(runtime));
  if (!exe) {
    const ask = runtime === "deno" ? ["eval", "console.log(Deno.execPath())"] : ["-e", "console.log(process.execPath)"];
    const r = spawnSync("npx", ["-y", `${runtime}@${PINNED[runtime]}`, ...ask], { encoding: "utf8" });
    if (r.status !== 0) {
      throw new InterlinkError(
        `${runtime} is not on PATH, and npx -y ${runtime}@${PINNED[runtime]} failed: ${r.stderr}`,
      );
    }
    exe = r.stdout.trim().split("\n").at(-1)!;
  }
  binaries.set(runtime, exe);
  return exe;
}

/** argv that runs `script` under `runtime` as the README has users register `mcp`: `bun X`, `deno run -A --quiet X`. */
function scriptArgv(runtime: Runtime, script: string): string[] {
  return runtime === "deno" ? [runtimeBinary("deno"), "run", "-A", "--quiet", script] : [runtimeBinary("bun"), script];
}

/** `interlink.ts bus` on a free loopback port under `runtime`, with `more` flags; resolves once it listens. */
function startBus(runtime: Runtime | undefined, dataDir: string, more: string[] = [], port = 0) {
  const args = ["bus", "--port", String(port), "--data", dataDir, ...more];
  return startChild(args, serverCommand(runtime, INTERLINK, args));
}

/** `bench.ts --serve-floor` under `runtime`; resolves once it listens. */
function startFloor(runtime: Runtime | undefined) {
  return startChild(["--serve-floor"], serverCommand(runtime, BENCH, ["--serve-floor"]));
}

/** An executable on PATH (or in /usr/sbin, where Debian puts nats-server), or null. */
function findOnPath(name: string): string | null {
  const dirs = [...(process.env.PATH ?? "").split(path.delimiter), "/usr/sbin", "/usr/local/sbin"];
  for (const dir of dirs) {
    const file = path.join(dir, name);
    if (dir && fs.existsSync(file)) return file;
  }
  return null;
}

/** A loopback port free right now, for a server the bench starts. */
function freeLoopbackPort(): Promise<number> {
  return new Promise<number>((resolve) => {
    const srv = net.createServer().listen(0, "127.0.0.1", () => {
      const p = (srv.address() as net.AddressInfo).port;
      srv.close(() => resolve(p));
    });
  });
}

/** Resolves once a bench server's `out` says `ready`; rejects, with its last words, if it exits first. */
function untilSays(child: ReturnType<typeof spawn>, out: NodeJS.ReadableStream, ready: string, name: string) {
  return new Promise<void>((resolve, reject) => {
    let buf = "";
    out.on("data", (d: Buffer) => {
      buf += d.toString();
      if (buf.includes(ready)) resolve();
    });
    child.once("exit", (code) => reject(new InterlinkError(`${name} exited with ${code}: ${buf.slice(-500)}`)));
  });
}

/**
 * The in-memory floor: the bus's three message routes with no disk, no
 * signature checks and no budgets, so a throughput figure can be read as a
 * share of what HTTP alone allows on the same machine, in the same run
 * (through the bus's own server, as the bus, since 2026-12-07).
 */
function floorHandler(): (req: Request) => Promise<Response> {
  const queues = new Map<string, { seq: number; payload: string }[]>();
  const waiters = new Map<string, Set<() => void>>();
  let seq = 0;
  const wait = (me: string, ms: number) =>
    new Promise<void>((resolve) => {
      const set = waiters.get(me) ?? new Set();
      waiters.set(me, set);
      const done = () => (clearTimeout(timer), set.delete(done), resolve());
      const timer = setTimeout(done, ms);
      set.add(done);
    });
  return async (req) => {
    const { pathname, query } = splitUrl(req.url);
    if (pathname === "/send") {
      const body = JSON.parse(await req.text());
      const q = queues.get(body.to) ?? [];
      q.push({ seq: ++seq, payload: JSON.stringify(body.payload) });
      queues.set(body.to, q);
      for (const w of [...(waiters.get(body.to) ?? [])]) w();
      return jsonResponse(202, '{"status":"queued"}');
    }
    if (pathname === "/recv") {
      const params = new URLSearchParams(query);
      const me = params.get("me") ?? "";
      if (!queues.get(me)?.length) await wait(me, Number(params.get("timeout_ms") ?? RECV_TIMEOUT_MS));
      const m = queues.get(me)?.[0];
      if (!m) return jsonResponse(200, '{"status":"timeout"}');
      return jsonResponse(
        200,
        `{"status":"message","envelope":{"payload":${m.payload},"ts":0},"ack":${JSON.stringify(`${me}\0${m.seq}`)}}`,
      );
    }
    if (pathname === "/ack") {
      const body = JSON.parse(await req.text());
      const q = queues.get(body.me) ?? [];
      const i = q.findIndex((m) => `${body.me}\0${m.seq}` === body.ack);
      if (i >= 0) q.splice(i, 1);
      return jsonResponse(200, '{"status":"acked"}');
    }
    return errorResponse(404, "the floor serves /send, /recv and /ack");
  };
}

/** --serve-floor: the floor on a free loopback port until SIGINT or SIGTERM. */
async function serveFloor(): Promise<number> {
  const server = await serveHttp(floorHandler(), "127.0.0.1", 0);
  process.stderr.write(
    `bench floor: listening on http://127.0.0.1:${server.port} (the in-memory floor: no disk, no checks)\n`,
  );
  await shutdownSignal();
  await server.stop();
  return 0;
}

/**
 * A redis-server that fsyncs every write (`appendfsync always`), on a free
 * loopback port: the durable queue the throughput bench compares our bus
 * with. Null when redis-server is not installed (it is not a dependency).
 */
async function startRedisServer(dir: string): Promise<{ port: number; child: ReturnType<typeof spawn> } | null> {
  const bin = findOnPath("redis-server");
  if (!bin) return null;
  const port = await freeLoopbackPort();
  fs.mkdirSync(dir, { recursive: true });
  const args = ["--port", `${port}`, "--bind", "127.0.0.1", "--dir", dir, "--save", "", "--appendonly", "yes"];
  const child = spawn(bin, [...args, "--appendfsync", "always"], { stdio: ["ignore", "pipe", "pipe"] });
  await untilSays(child, child.stdout!, "Ready to accept connections", "redis-server");
  return { port, child };
}

/** A nats-server with JetStream on a free loopback port, for the bench (max_payload as a bus takes). */
async function startNatsServer(dir: string): Promise<{ url: string; child: ReturnType<typeof spawn> } | null> {
  const bin = findOnPath("nats-server");
  if (!bin) return null;
  const port = await freeLoopbackPort();
  fs.mkdirSync(dir, { recursive: true });
  const conf = path.join(dir, "nats.conf");
  fs.writeFileSync(conf, `listen: 127.0.0.1:${port}\nmax_payload: 2MB\njetstream { store_dir: "${dir}" }\n`);
  const child = spawn(bin, ["-c", conf], { stdio: ["ignore", "ignore", "pipe"] });
  await untilSays(child, child.stderr!, "Server is ready", "nats-server");
  return { url: `nats://127.0.0.1:${port}`, child };
}

// -- a Redis client, by hand (RESP over one socket: no dependency) ----------

/** One Redis connection, one command at a time (what each bench sender or receiver does): its reply. */
async function redisConnection(port: number): Promise<{ call(...args: string[]): Promise<unknown>; close(): void }> {
  const socket = net.connect(port, "127.0.0.1");
  await new Promise<void>((resolve, reject) => socket.once("connect", resolve).once("error", reject));
  socket.setNoDelay(true);
  let buf: Buffer = Buffer.alloc(0);
  const waiting: ((value: unknown) => void)[] = [];
  socket.on("data", (d: Buffer) => {
    buf = buf.length ? Buffer.concat([buf, d]) : d;
    for (let r = parseResp(buf, 0); r; r = parseResp(buf, 0)) {
      buf = buf.subarray(r.end);
      waiting.shift()!(r.value);
    }
  });
  return {
    call: (...args) =>
      new Promise((resolve) => {
        waiting.push(resolve);
        socket.write(`*${args.length}\r\n${args.map((a) => `$${utf8Bytes(a)}\r\n${a}\r\n`).join("")}`);
      }),
    close: () => socket.destroy(),
  };
}

/** One RESP reply starting at `i`, or null if it has not all arrived. Errors come back as Error values. */
function parseResp(b: Buffer, i: number): { value: unknown; end: number } | null {
  const nl = b.indexOf("\r\n", i);
  if (nl < 0) return null;
  const type = String.fromCharCode(b[i]), line = b.toString("utf8", i + 1, nl), n = Number(line);
  if (type === "+") return { value: line, end: nl + 2 };
  if (type === "-") return { value: new Error(line), end: nl + 2 };
  if (type === ":") return { value: n, end: nl + 2 };
  if (n < 0) return { value: null, end: nl + 2 };
  if (type === "$") {
    return b.length < nl + 4 + n ? null : { value: b.toString("utf8", nl + 2, nl + 2 + n), end: nl + 4 + n };
  }
  const items: unknown[] = [];
  let at = nl + 2;
  for (let k = 0; k < n; k++) {
    const r = parseResp(b, at);
    if (!r) return null;
    items.push(r.value);
    at = r.end;
  }
  return { value: items, end: at };
}

// ============================================================================
// The loads
// ============================================================================

/** Runs `load` against the server `pid`: messages per second, and the server's CPU and RSS meanwhile. */
async function timedLoad(pid: number, messages: number, load: () => Promise<unknown>) {
  const [cpu0, main0] = [cpuSeconds(pid), mainThreadCpuNs(pid)];
  const t0 = performance.now();
  await load();
  const seconds = (performance.now() - t0) / 1000;
  const [cpu1, main1] = [cpuSeconds(pid), mainThreadCpuNs(pid)];
  return {
    msgs_per_s: Math.round(messages / seconds),
    seconds: Math.round(seconds * 1000) / 1000,
    server_cpu_percent: cpu0 === null || cpu1 === null ? null : Math.round(((cpu1 - cpu0) / seconds) * 100),
    // Its one JavaScript thread's share: what the event loop spent on a message (the rest ran on other threads).
    server_main_thread_us_per_msg: main0 === null || main1 === null
      ? null
      : Math.round((main1 - main0) / 1000 / messages),
    server_rss_mb: rssMb(pid),
  };
}

/**
 * One server's share of the throughput bench: `pairs` senders and receivers, send → recv → ack, in order;
 * with `batch`, each recv asks for up to RECV_BATCH and acks them in one request (our bus's extension).
 */
async function throughputLoad(url: string, pid: number, signed: SignedMessage[][], batch = false) {
  const perPair = signed[0].length;
  return await timedLoad(pid, signed.length * perPair, () =>
    Promise.all(signed.map(async (list, i) => {
      const to = `${list[0].to}#bench-${i}`;
      let failed = false; // a send that fails ends the receiving too (it would wait for it forever)
      const sender = (async () => {
        for (const payload of list) {
          const r = await postJson(`${url}/send`, { to, payload });
          if (r.status !== 202) throw new InterlinkError(`send answered ${r.status}`);
          await r.body?.cancel();
        }
      })().catch((e) => {
        failed = true;
        throw e;
      });
      for (let got = 0; got < perPair && !failed;) {
        const max = batch ? `&max=${RECV_BATCH}` : "";
        const body = await (await fetch(`${url}/recv?me=${encodeURIComponent(to)}&timeout_ms=10000${max}`)).json();
        const items: { envelope: { payload: SignedMessage }; ack: string }[] = body.status === "message"
          ? [body]
          : body.status === "messages"
          ? body.messages
          : [];
        if (!items.length) continue;
        for (const m of items) {
          if (m.envelope.payload.msg_id !== list[got++].msg_id) {
            throw new InterlinkError(`out of order: ${m.envelope.payload.msg_id} at ${got - 1}`);
          }
        }
        const keys = items.map((m) => m.ack);
        const a = await postJson(`${url}/ack`, { me: to, ...(keys.length === 1 ? { ack: keys[0] } : { acks: keys }) });
        await a.body?.cancel();
      }
      await sender;
    })));
}

/**
 * The throughput load through Redis as a reliable queue: LPUSH to send,
 * BLMOVE to a processing list to receive, LREM from it to ack; same pairs,
 * same payloads, same order checks as `throughputLoad`.
 */
async function redisLoad(port: number, pid: number, signed: SignedMessage[][]) {
  const perPair = signed[0].length;
  return await timedLoad(pid, signed.length * perPair, () =>
    Promise.all(signed.map(async (list, i) => {
      const [sender, receiver] = await Promise.all([redisConnection(port), redisConnection(port)]);
      try {
        const queue = `bench-${i}`, processing = `bench-${i}:processing`;
        const sending = (async () => {
          for (const m of list) {
            const r = await sender.call("LPUSH", queue, JSON.stringify(m));
            if (r instanceof Error) throw r;
          }
        })();
        for (let got = 0; got < perPair;) {
          const item = await receiver.call("BLMOVE", queue, processing, "RIGHT", "LEFT", "10");
          if (item instanceof Error) throw item;
          if (typeof item !== "string") continue;
          if (JSON.parse(item).msg_id !== list[got++].msg_id) {
            throw new InterlinkError(`redis: out of order at ${got - 1}`);
          }
          const r = await receiver.call("LREM", processing, "1", item);
          if (r instanceof Error) throw r;
        }
        await sending;
      } finally {
        sender.close();
        receiver.close();
      }
    })));
}

/**
 * One relay under the agent's own load, through the agent's own relay client:
 * `pairs` senders each send `perPair` signed messages to their own route
 * while its reader receives each, journals it (append + fdatasync) and acks
 * it, as an agent does; then one message at a time, send → received latency.
 */
async function relayLoad(relay: Relay, id: Identity, dir: string, pid: number, pairs: number, perPair: number) {
  fs.mkdirSync(dir, { recursive: true });
  const signed = await Promise.all(
    Array.from(
      { length: pairs },
      () =>
        Promise.all(
          Array.from({ length: perPair }, (_, n) => signMessage(id, { to: id.publicKey, text: `m${n}` }, Date.now())),
        ),
    ),
  );
  const stop = new AbortController();
  const receive = async (route: string, journal: JsonlWriter, expect: SignedMessage[]) => {
    for (let got = 0; got < expect.length;) {
      if (stop.signal.aborted) throw new InterlinkError(`${relay.name}: a send failed; the bench stops`);
      const { items, ackMany } = await relay.recv(route, stop.signal);
      if (!items.length) continue;
      for (const h of items) {
        if ((h.payload as SignedMessage).msg_id !== expect[got++].msg_id) {
          throw new InterlinkError(`${relay.name}: out of order at ${got - 1}`);
        }
      }
      journal.append(items.map((h) => ({ t: "in", msg: h.payload })));
      await journal.sync();
      await (ackMany ? ackMany(items) : Promise.all(items.map((h) => h.ack())));
    }
  };
  // Warm up: the connection, the stream and each route's consumer exist before the clock starts.
  await Promise.all(signed.map(async (list, i) => {
    const route = `${id.publicKey}#bench-${i}`;
    const warm = await signMessage(id, { to: id.publicKey, text: "warm" }, Date.now());
    await relay.send(route, warm, SEND_TIMEOUT_MS);
    await receive(route, new JsonlWriter(path.join(dir, `warm-${i}.jsonl`)), [warm]);
    return list;
  }));
  const cpu0 = cpuSeconds(pid);
  const t0 = performance.now();
  await Promise.all(signed.map(async (list, i) => {
    const route = `${id.publicKey}#bench-${i}`;
    const journal = new JsonlWriter(path.join(dir, `in-${i}.jsonl`));
    const sender = (async () => {
      for (const m of list) await relay.send(route, m, SEND_TIMEOUT_MS);
    })().catch((e) => {
      stop.abort(); // the receivers would wait for it forever
      throw e;
    });
    await Promise.all([receive(route, journal, list), sender]);
    journal.close();
  }));
  const seconds = (performance.now() - t0) / 1000;
  const cpu1 = cpuSeconds(pid);
  const latencies: number[] = [];
  const route = `${id.publicKey}#latency`;
  const journal = new JsonlWriter(path.join(dir, "latency.jsonl"));
  for (let n = 0; n < 220; n++) {
    const m = await signMessage(id, { to: id.publicKey, text: `l${n}` }, Date.now());
    const t = performance.now();
    const [, received] = await Promise.all([
      relay.send(route, m, SEND_TIMEOUT_MS),
      receive(route, journal, [m]).then(() => performance.now()),
    ]);
    if (n >= 20) latencies.push(received - t); // the first 20 warm the route
  }
  journal.close();
  stop.abort();
  latencies.sort((x, y) => x - y);
  return {
    relay: relay.name.replace(/:\d+$/, ""),
    messages: pairs * perPair,
    msgs_per_s: Math.round((pairs * perPair) / seconds),
    relay_cpu_percent: cpu0 === null || cpu1 === null ? null : Math.round(((cpu1 - cpu0) / seconds) * 100),
    relay_rss_mb: rssMb(pid),
    send_to_journaled_ms_p50: Math.round(percentile(latencies, 50) * 100) / 100,
    send_to_journaled_ms_p99: Math.round(percentile(latencies, 99) * 100) / 100,
  };
}

// ============================================================================
// The parts of a run
// ============================================================================

/**
 * 8 pairs × 500 messages, then 64 pairs × 125, through our bus (its one
 * server since 2026-12-07: --guard off is no longer measured apart), through the in-memory floor and through
 * Redis with `appendfsync always` when it is installed, in one run, each
 * figure also as a ratio to the floor and to Redis.
 */
async function benchThroughput(
  root: string,
  progress: (m: string) => void,
  sample: SignedMessage,
  id: Identity,
  servers: Runtime | undefined,
) {
  const pairs = 8, perPair = 500, widePairs = 64, widePerPair = 125;
  // Signed ahead of the clock: the bus verifies each one, which is part of what is measured.
  const sign = (n: number, per: number) =>
    Promise.all(
      Array.from({ length: n }, () =>
        Promise.all(Array.from({ length: per }, () =>
          signMessage(
            id,
            { to: id.publicKey, text: sample.text, task_id: sample.task_id, status: sample.status },
            Date.now(),
          )))),
    );
  const signed = await sign(pairs, perPair), wide = await sign(widePairs, widePerPair);
  type Start = () => ReturnType<typeof startChild>;
  const started: [string, Start][] = [
    ["floor", () => startFloor(servers)],
    ["bus", () => startBus(servers, path.join(root, "throughput"))],
  ];
  const out: Record<string, unknown> = {
    load: `${pairs} pairs × ${perPair}, send → recv → ack; "_64": ${widePairs} pairs × ${widePerPair}`,
    load_generator: runtimeName(),
    servers_runtime: servers ?? runtimeName(),
    ...(OWN_RUNTIME === "deno"
      ? { note: "the load generator runs under Deno; the README's figures drive every server from Bun (--bus-runtime)" }
      : {}),
  };
  for (const [name, start] of started) {
    const server = await start();
    try {
      progress(`throughput: ${name} (pid ${server.child.pid}), ${pairs} pairs × ${perPair}`);
      out[name] = await throughputLoad(server.url, server.child.pid!, signed);
      progress(`throughput: ${name}, ${widePairs} pairs × ${widePerPair}`);
      out[`${name}_64`] = await throughputLoad(server.url, server.child.pid!, wide);
      if (name === "bus") {
        progress(`throughput: bus again, batched recv and ack (as our agents use it)`);
        out.bus_batched = await throughputLoad(server.url, server.child.pid!, signed, true);
      }
    } finally {
      await stopChild(server.child);
    }
  }
  const redis = await startRedisServer(path.join(root, "redis"));
  if (!redis) {
    out.redis = "skipped: redis-server is not on PATH (install it with: sudo apt-get install -y redis-server)";
  } else {
    try {
      progress(`throughput: Redis, appendfsync always (pid ${redis.child.pid}), LPUSH → BLMOVE → LREM, same load`);
      out.redis = await redisLoad(redis.port, redis.child.pid!, signed);
      out.redis_64 = await redisLoad(redis.port, redis.child.pid!, wide);
    } finally {
      await stopChild(redis.child);
    }
  }
  const rate = (name: string) => (out[name] as { msgs_per_s?: number }).msgs_per_s;
  const ratio = (a: number, b: number) => Math.round((a / b) * 100) / 100;
  const compared = [...started.slice(1).map(([n]) => n), "bus_batched"];
  for (const name of [...compared, ...(redis ? ["redis"] : [])]) {
    out[`${name}_over_floor`] = ratio(rate(name)!, rate("floor")!);
  }
  out.bus_64_over_floor_64 = ratio(rate("bus_64")!, rate("floor_64")!);
  if (redis) {
    for (const name of compared) out[`${name}_over_redis`] = ratio(rate(name)!, rate("redis")!);
    out.bus_64_over_redis_64 = ratio(rate("bus_64")!, rate("redis_64")!);
  }
  return out;
}

/**
 * 100,000 un-acked messages for 300 recipients: written in the layout of the JSONL bus before the queue moved to
 * SQLite (one `m` record a line), taken in by a bus started on them (the upgrade, timed), then that bus restarted on
 * its own queue database (the restart, timed to the first recv): the figure compared with the JSONL bus's own restart
 * on the same 100,000.
 */
async function benchRecovery(
  root: string,
  progress: (m: string) => void,
  sample: SignedMessage,
  servers: Runtime | undefined,
) {
  const dir = path.join(root, "recovery");
  fs.mkdirSync(dir, { recursive: true });
  const total = 100_000, recipients = 300; // 333 each, under the per-recipient cap
  const p = JSON.stringify(sample);
  const literal = JSON.stringify(p), size = utf8Bytes(p), from = JSON.stringify(sample.from);
  const fd = fs.openSync(path.join(dir, "queue.jsonl"), "w");
  for (let n = 1; n <= total; n += 1000) {
    let chunk = "";
    for (let k = n; k < n + 1000; k++) {
      chunk += `{"t":"m","q":"r${
        k % recipients
      }","n":${k},"ts":${Date.now()},"s":${from},"z":${size},"p":${literal}}\n`;
    }
    fs.writeSync(fd, chunk);
  }
  fs.closeSync(fd);
  const jsonlBytes = fs.statSync(path.join(dir, "queue.jsonl")).size;
  /** A bus started on `dir`: to its first recv, what it said it recovered and in how long, its RSS. */
  const start = async () => {
    const t0 = performance.now();
    const bus = await startBus(servers, dir, ["--max-mb", "1000"]);
    try {
      const first = await (await fetch(`${bus.url}/recv?me=r1&timeout_ms=0`)).json();
      const ms = Math.round(performance.now() - t0);
      if (first.status !== "message") throw new InterlinkError("the recovered bus had nothing for r1");
      await sleep(500);
      const said = bus.stderr.join("\n").match(/recovered (\d+) un-acked messages for \d+ recipients in (\d+) ms/);
      return {
        messages: said ? Number(said[1]) : "the bus did not say",
        bus_open_ms: said ? Number(said[2]) : null,
        first_recv_ms: ms,
        rss_mb_after: rssMb(bus.child.pid!),
      };
    } finally {
      await stopChild(bus.child);
    }
  };
  progress(
    `recovery: ${total} un-acked messages as a JSONL bus left them (${Math.round(jsonlBytes / 1e6)} MB); upgrading`,
  );
  const upgrade = { ...await start(), jsonl_mb: Math.round(jsonlBytes / 1e5) / 10 };
  progress("recovery: restarting the bus on its own queue database");
  return { ...await start(), queue_db_mb: queueFileMb(dir), upgrade };
}

async function benchIdle(root: string, progress: (m: string) => void, servers: Runtime | undefined) {
  const bus = await startBus(servers, path.join(root, "idle"));
  const waiters = 500;
  const port = Number(new URL(bus.url).port);
  const sockets: net.Socket[] = [];
  try {
    progress(`idle: ${waiters} concurrent long-polling recvs (raw sockets, so no client pool caps them)`);
    const rssBefore = rssMb(bus.child.pid!);
    await Promise.all(Array.from({ length: waiters }, (_, i) =>
      new Promise<void>((resolve, reject) => {
        const sock = net.connect(port, "127.0.0.1", () => {
          sock.write(`GET /recv?me=idle-${i}&timeout_ms=60000 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n`);
          resolve();
        });
        sock.on("error", reject);
        sockets.push(sock);
      })));
    await sleep(1000);
    const cpu0 = cpuSeconds(bus.child.pid!), wall0 = performance.now();
    await sleep(5000);
    const cpu1 = cpuSeconds(bus.child.pid!), wall1 = performance.now();
    // Prove they are all registered: a message for the last waiter is answered on its socket at once.
    const answered = new Promise<number>((resolve) => {
      const t = performance.now();
      sockets[waiters - 1].once("data", () => resolve(Math.round(performance.now() - t)));
    });
    const r = await postJson(`${bus.url}/send`, { to: `idle-${waiters - 1}`, payload: "wake" });
    await r.body?.cancel();
    return {
      waiters,
      bus_rss_mb_before: rssBefore,
      bus_rss_mb_idle: rssMb(bus.child.pid!),
      bus_cpu_percent_idle: cpu0 === null || cpu1 === null
        ? null
        : Math.round(((cpu1 - cpu0) / ((wall1 - wall0) / 1000)) * 1000) / 10,
      wake_ms_for_last_waiter: await answered,
    };
  } finally {
    for (const s of sockets) s.destroy();
    await stopChild(bus.child);
  }
}

async function benchAgents(root: string, progress: (m: string) => void, servers: Runtime | undefined) {
  const bus = await startBus(servers, path.join(root, "agents-bus"));
  const sessions: McpSession[] = [];
  try {
    const coldStarts: number[] = [];
    for (let i = 0; i < 5; i++) {
      const t0 = performance.now();
      const { session } = await startDemoNode(root, `cold-${i}`, bus.url);
      await session.client.listTools();
      coldStarts.push(performance.now() - t0);
      await session.close();
    }
    progress(
      `agents: cold start to first tools/list ${
        coldStarts.map((n) => Math.round(n)).join(", ")
      } ms; now 200 messages alice → bob`,
    );
    const [a, b] = await Promise.all([startDemoNode(root, "alice", bus.url), startDemoNode(root, "bob", bus.url)]);
    sessions.push(a.session, b.session);
    for (const [me, other, name] of [[a, b, "bob"], [b, a, "alice"]] as const) {
      await addPeer(path.join(root, me.session.label, "peers.json"), name, other.id.publicKey);
    }
    // From the send_message call to bob's push, however long the tool itself takes to answer (it answers once the
    // message is durable on the bus, and its "sent" record too).
    const latencies: number[] = [], toolTimes: number[] = [];
    for (let n = 0; n < 220; n++) {
      const t0 = performance.now();
      const pushed = b.session.waitEvent((e) => e.content.includes(`#${n}#`), 10_000).then(() => performance.now());
      await a.session.ok("send_message", {
        to: "bob",
        text: `message #${n}#`,
        task_id: "bench",
        status: n ? "update" : undefined,
      });
      const answered = performance.now();
      if (n >= 20) { // the first 20 warm the JIT and connections
        latencies.push((await pushed) - t0);
        toolTimes.push(answered - t0);
      }
      await pushed;
    }
    latencies.sort((x, y) => x - y);
    toolTimes.sort((x, y) => x - y);
    await sleep(3000);
    return {
      cold_start_ms_median: Math.round([...coldStarts].sort((x, y) => x - y)[2]),
      cold_start_ms: coldStarts.map((n) => Math.round(n)),
      send_to_push_ms_p50: percentile(latencies, 50),
      send_to_push_ms_p99: percentile(latencies, 99),
      send_tool_answer_ms_p50: percentile(toolTimes, 50),
      messages: latencies.length,
      idle_agent_rss_mb: rssMb(a.session.pid!),
    };
  } finally {
    await Promise.allSettled(sessions.map((s) => s.close()));
    await stopChild(bus.child);
  }
}

/**
 * Seal: alice sends 200 messages each to bob, whose node said (by receipt) that it opens sealed mail, so each goes
 * sealed, and to carol, whom alice's seals.json holds as opening none (a ts no receipt passes), so each goes plain;
 * interleaved, so both see the same machine. Then, in this process, seal + gate beside sign + gate for the same texts.
 */
async function benchSeal(root: string, progress: (m: string) => void, servers: Runtime | undefined) {
  const bus = await startBus(servers, path.join(root, "seal-bus")), home = path.join(root, "seal");
  const sessions: McpSession[] = [];
  try {
    const [a, b, c] = await Promise.all(["alice", "bob", "carol"].map((n) => startDemoNode(home, n, bus.url)));
    sessions.push(a.session, b.session, c.session);
    const dir = (x: typeof a) => path.join(home, x.session.label);
    for (const [me, other, name] of [[a, b, "bob"], [b, a, "alice"], [a, c, "carol"], [c, a, "alice"]] as const) {
      await addPeer(path.join(dir(me), "peers.json"), name, other.id.publicKey);
    }
    const seals = path.join(dir(a), "state", "seals.json");
    fs.writeFileSync(seals, JSON.stringify({ [c.id.publicKey]: { opens: false, ts: Number.MAX_SAFE_INTEGER } }));
    const opens = () => JSON.parse(fs.readFileSync(seals, "utf8"))[b.id.publicKey]?.opens === true;
    for (let n = 0; !opens(); n++) {
      if (n === 50) throw new InterlinkError("bob's node never said it opens sealed mail");
      await a.session.ok("send_message", { to: "bob", text: "hello in the clear" });
      await sleep(100);
    }
    progress("seal: bob opens sealed mail; now 200 messages each to bob (sealed) and carol (plain), interleaved");
    const lat = { sealed: [] as number[], plain: [] as number[] };
    for (let n = 0; n < 220; n++) {
      for (const [to, who, kind] of [["bob", b, "sealed"], ["carol", c, "plain"]] as const) {
        const t0 = performance.now();
        const pushed = who.session.waitEvent((e) => e.content.includes(`#${n}#`), 10_000).then(() => performance.now());
        const status = n ? "update" : undefined;
        await a.session.ok("send_message", { to, text: `message #${n}#`, task_id: "bench", status });
        const at = await pushed;
        if (n >= 20) lat[kind].push(at - t0); // the first 20 warm the JIT and connections
      }
    }
    for (const l of Object.values(lat)) l.sort((x, y) => x - y);
    const [alice, bob] = await Promise.all(
      [1, 2].map(() => identityFromSeed(crypto.getRandomValues(new Uint8Array(32)))),
    );
    const peers = { byName: new Map([["alice", alice.publicKey]]), byKey: new Map([[alice.publicKey, "alice"]]) };
    const gate = (p: unknown) => decide(p, bob.publicKey, peers, Date.now(), new ReplayMemory(), new Map(), bob.opens);
    const text = "a line of a task, as a model writes one to a peer; ".repeat(8);
    const timed = async (make: (i: number) => Promise<unknown>) => {
      const t0 = performance.now();
      for (let i = 0; i < 500; i++) {
        if ((await gate(await make(i)) as { verdict: string }).verdict !== "deliver") throw 0;
      }
      return ((performance.now() - t0) / 500) * 1000;
    };
    const signed = (i: number) => signMessage(alice, { to: bob.publicKey, text: `${i} ${text}` }, Date.now());
    await timed(signed); // warm
    const plainUs = await timed(signed), sealedUs = await timed(async (i) => sealMessage(alice, await signed(i)));
    const p50 = { sealed: percentile(lat.sealed, 50), plain: percentile(lat.plain, 50) };
    return {
      sealed_send_to_push_ms_p50: p50.sealed,
      plain_send_to_push_ms_p50: p50.plain,
      sealed_to_plain_p50: Math.round((p50.sealed / p50.plain) * 100) / 100,
      sealed_send_to_push_ms_p99: percentile(lat.sealed, 99),
      plain_send_to_push_ms_p99: percentile(lat.plain, 99),
      messages_each: lat.sealed.length,
      sign_and_gate_us: Math.round(plainUs),
      sign_seal_and_gate_us: Math.round(sealedUs),
      crypto_ratio: Math.round((sealedUs / plainUs) * 100) / 100,
    };
  } finally {
    await Promise.allSettled(sessions.map((s) => s.close()));
    await stopChild(bus.child);
  }
}

/**
 * Sessions: 10 sessions of one key and 10 of another, each paired with one of
 * the other side, exchange 200 messages each way through the MCP tools; every
 * session must get exactly its partner's 200, in order: none misrouted, lost
 * or duplicated.
 */
async function benchSessions(root: string, progress: (m: string) => void, servers: Runtime | undefined) {
  const bus = await startBus(servers, path.join(root, "sessions-bus"));
  const sessions: McpSession[] = [];
  try {
    const files = await Promise.all(["a", "b"].map(async (n) => {
      const dir = path.join(root, `sessions-${n}`);
      const seed = crypto.getRandomValues(new Uint8Array(32));
      writeKeyFile(path.join(dir, "id.key"), seed, false);
      return { n, dir, id: await identityFromSeed(seed) };
    }));
    for (const [me, other] of [[files[0], files[1]], [files[1], files[0]]]) {
      await addPeer(path.join(me.dir, "peers.json"), other.n, other.id.publicKey);
    }
    const pairs = 10, perSession = 200;
    progress(
      `sessions: ${pairs} sessions of each of two keys, ${perSession} messages from each session to its partner`,
    );
    for (const f of files) {
      for (let i = 0; i < pairs; i++) {
        sessions.push(
          await McpSession.start(
            `${f.n}${i}`,
            selfCommand(["mcp"]),
            childEnv({
              INTERLINK_KEY: path.join(f.dir, "id.key"),
              INTERLINK_PEERS: path.join(f.dir, "peers.json"),
              INTERLINK_STATE: path.join(f.dir, "state"),
              INTERLINK_CONFIG: path.join(f.dir, "config.json"),
              INTERLINK_URL: bus.url,
              INTERLINK_SESSION: `s${i}`,
              INTERLINK_DELIVERY: "channel",
            }),
          ),
        );
      }
    }
    const t0 = performance.now();
    await Promise.all(sessions.map(async (s, k) => {
      const other = k < pairs ? "b" : "a";
      for (let n = 0; n < perSession; n++) {
        await s.ok("send_message", { to: other, text: `${s.label}:${n}`, session: `s${k % pairs}` });
      }
    }));
    const deadline = Date.now() + 60_000;
    const expected = (k: number) => `${k < pairs ? "b" : "a"}${k % pairs}`;
    while (Date.now() < deadline && sessions.some((s) => s.events.length < perSession)) await sleep(100);
    await sleep(1000); // anything extra (a duplicate, a misrouted message) has a moment to show up
    let misrouted = 0, duplicated = 0, lost = 0, outOfOrder = 0;
    sessions.forEach((s, k) => {
      const texts = s.events.map((e) => e.content);
      misrouted += texts.filter((t) => !t.startsWith(`${expected(k)}:`)).length;
      const mine = texts.filter((t) => t.startsWith(`${expected(k)}:`)).map((t) => Number(t.split(":")[1]));
      duplicated += mine.length - new Set(mine).size;
      lost += perSession - new Set(mine).size;
      outOfOrder += mine.filter((n, i) => i > 0 && n < mine[i - 1]).length;
    });
    return {
      sessions: sessions.length,
      messages: sessions.length * perSession,
      seconds: Math.round(performance.now() - t0) / 1000,
      misrouted,
      lost,
      duplicated,
      out_of_order: outOfOrder,
    };
  } finally {
    await Promise.allSettled(sessions.map((s) => s.close()));
    await stopChild(bus.child);
  }
}

/** The idle-sessions part's counts, and how long each is left idle before (settling) and while it is measured. */
const IDLE_SESSION_COUNTS = [10, 50, 100];
const IDLE_SETTLE_MS = 10_000;
const IDLE_WINDOW_MS = 60_000; // two announcements and two sweeps for ended sessions (every 30 s) fall in it

/** CPU seconds the processes `pids` have used in all; null without /proc. */
function cpuSecondsOf(pids: number[]): number | null {
  let sum = 0;
  for (const pid of pids) {
    const s = cpuSeconds(pid);
    if (s === null) return null;
    sum += s;
  }
  return sum;
}

/**
 * Idle sessions: 10, 50 and 100 `mcp` sessions on one bus doing nothing, first all of one node (one key and state
 * folder: one person's parallel agents, a CI box), then each its own node, in the same run. An idle session waits on
 * its long poll and costs next to nothing: CPU per session, flat in the number of sessions and of sessions per node
 * (one node's as a ratio to one node each's at the same count: 1 when it is).
 */
async function benchIdleSessions(root: string, progress: (m: string) => void, servers: Runtime | undefined) {
  const bus = await startBus(servers, path.join(root, "idle-sessions-bus"));
  const rows: Record<string, unknown>[] = [];
  try {
    for (const count of IDLE_SESSION_COUNTS) {
      const row: Record<string, unknown> = { sessions: count };
      for (const shape of ["one_node", "node_each"] as const) {
        progress(`idle-sessions: ${count} sessions, ${shape === "one_node" ? "all of one node" : "each its own node"}`);
        const nodes = await Promise.all(
          Array.from(
            { length: shape === "one_node" ? 1 : count },
            (_, i) => footNode(root, `idle-${count}-${shape}-${i}`),
          ),
        );
        const sessions: McpSession[] = [];
        try {
          for (let i = 0; i < count; i++) {
            const node = nodes[i % nodes.length];
            const env = childEnv({
              INTERLINK_KEY: node.key,
              INTERLINK_PEERS: node.peers,
              INTERLINK_STATE: node.state,
              INTERLINK_CONFIG: node.config,
              INTERLINK_URL: bus.url,
              INTERLINK_NAME: node.name,
              INTERLINK_SESSION: `s${i}`,
            });
            sessions.push(await McpSession.start(`${node.name}-s${i}`, selfCommand(["mcp"]), env));
          }
          await Promise.all(sessions.map((s) => s.waitStderr(/ info: ready: /, 120_000)));
          await sleep(IDLE_SETTLE_MS);
          const pids = sessions.map((s) => s.pid!);
          const cpu0 = cpuSecondsOf(pids), busCpu0 = cpuSeconds(bus.child.pid!), t0 = performance.now();
          await sleep(IDLE_WINDOW_MS);
          const cpu1 = cpuSecondsOf(pids), busCpu1 = cpuSeconds(bus.child.pid!), ms = performance.now() - t0;
          const all = cpuPercent(cpu0, cpu1, ms);
          row[shape] = {
            cpu_percent_all: all,
            cpu_percent_per_session: all === null ? null : Math.round((all / count) * 1000) / 1000,
            bus_cpu_percent: cpuPercent(busCpu0, busCpu1, ms),
          };
        } finally {
          await Promise.allSettled(sessions.map((s) => s.close()));
        }
      }
      const per = (shape: string) => (row[shape] as { cpu_percent_per_session: number | null }).cpu_percent_per_session;
      row.one_node_per_session_to_node_each = ratio(per("one_node"), per("node_each"));
      rows.push(row);
    }
    const first = (rows[0].one_node as { cpu_percent_per_session: number | null }).cpu_percent_per_session;
    const last = (rows.at(-1)!.one_node as { cpu_percent_per_session: number | null }).cpu_percent_per_session;
    return {
      window_s: IDLE_WINDOW_MS / 1000,
      runtime: OWN_RUNTIME,
      counts: rows,
      one_node_100_to_10_per_session: ratio(last, first),
    };
  } finally {
    await stopChild(bus.child);
  }
}

/**
 * Floods, each against a fresh bus: 50,000 distinct keys announcing once (the
 * roster must stay at its cap); one client posting 900 KB opaque payloads to
 * 300 recipients (the global byte budget must answer 507); one key posting
 * 250 KB signed messages to 300 recipients (its own budget must answer 429);
 * 2,000 signed junk messages to one recipient (the per-recipient cap); then
 * issue 34's (ownership, bodies in flight, tiny messages, the roster) and slow
 * readers of large answers. Memory must stay bounded: each reports the bus's
 * RSS and its ratio to the same bus idle.
 */
async function benchFlood(root: string, progress: (m: string) => void, servers: Runtime | undefined) {
  /** `rest`: also the bus's RSS 5 s after the flood's clients went away. */
  const flood = async (name: string, run: (url: string) => Promise<Record<string, unknown>>, rest = false) => {
    const bus = await startBus(servers, path.join(root, `flood-${name}`));
    try {
      const rssIdle = rssMb(bus.child.pid!);
      let peak = rssIdle ?? 0;
      const sampler = setInterval(() => peak = Math.max(peak, rssMb(bus.child.pid!) ?? 0), 50);
      const t0 = performance.now();
      const result = await run(bus.url).finally(() => clearInterval(sampler));
      const seconds = Math.round(performance.now() - t0) / 1000;
      const rss = rssMb(bus.child.pid!);
      const rested = rest ? await rssAfterRest(bus.child.pid!) : undefined;
      return {
        ...result,
        seconds,
        bus_rss_mb_peak: peak,
        bus_rss_mb_after: rss,
        bus_rss_mb_idle: rssIdle,
        peak_ratio_to_idle: rssIdle ? Math.round((peak / rssIdle) * 100) / 100 : null,
        ...(rested !== undefined
          ? {
            bus_rss_mb_rested: rested,
            rested_ratio_to_idle: rssIdle && rested ? Math.round((rested / rssIdle) * 100) / 100 : null,
          }
          : {}),
      };
    } finally {
      await stopChild(bus.child);
    }
  };
  /** Posts `count` bodies, `width` at a time; counts the answers by status. */
  const post = async (url: string, count: number, width: number, body: (i: number) => Promise<unknown> | unknown) => {
    const statuses: Record<string, number> = {};
    for (let done = 0; done < count;) {
      const batch = await Promise.all(Array.from({ length: Math.min(width, count - done) }, async (_, i) => {
        const r = await postJson(url, await body(done + i), 60_000);
        await r.body?.cancel();
        return r.status;
      }));
      for (const status of batch) statuses[status] = (statuses[status] ?? 0) + 1;
      done += batch.length;
    }
    return statuses;
  };
  const keys = 50_000;
  progress(`flood: ${keys} distinct keys announce once each (signed, valid)`);
  const announce = await flood("announce", async (url) => {
    const statuses = await post(`${url}/announce`, keys, 200, async (i) => {
      const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
      const session = { session_id: `flood-${i}`, cwd: "/tmp", git_root: "", summary: "x".repeat(100) };
      return await signAnnouncement(id, `flood-${i}`, Date.now(), session);
    });
    const roster = await (await fetch(`${url}/roster`)).json();
    return { keys, statuses, roster_entries: roster.roster.length, roster_cap: ROSTER_CAP };
  });
  progress("flood: 300 recipients × 900 KB opaque payloads from one client");
  const opaque = "z".repeat(900_000);
  const opaqueBytes = await flood("opaque", async (url) => ({
    statuses: await post(`${url}/send`, 300, 8, (i) => ({ to: `victim-${i}`, payload: { junk: opaque } })),
    budget_mb: TOTAL_BYTES_MAX >> 20,
  }));
  progress("flood: one key, 300 recipients × 250 KB signed messages");
  const eve = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
  const big = "y".repeat(250_000);
  const signedBytes = await flood("signed", async (url) => ({
    statuses: await post(`${url}/send`, 300, 8, async (i) => {
      const to = (await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)))).publicKey;
      return { to, payload: await signMessage(eve, { to, text: big, task_id: `flood-${i}` }, Date.now()) };
    }),
    sender_budget_mb: SENDER_BYTES_MAX >> 20,
  }));
  progress("flood: 2,000 signed junk messages to one recipient");
  const victim = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
  const junk = await flood("junk", async (url) => {
    const statuses = await post(`${url}/send`, 2_000, 50, async (i) => ({
      to: victim.publicKey,
      payload: await signMessage(eve, { to: victim.publicKey, text: `junk ${i}` }, Date.now()),
    }));
    return { statuses, queue_cap: QUEUE_CAP };
  });
  progress("flood: one key proves 100,001 routes of its own; then 2,000 keys prove one each");
  const owners = await flood("owners", (url) => ownersFlood(url, root));
  progress("flood: 1,000 connections each send all but the last 100 bytes of a 2 MB /send, and drip");
  const bodies = await flood("bodies", (url) => bodiesFlood(url), true);
  progress("flood: 3,000,000 tiny opaque payloads to 100,000 routes, 64 to a request");
  const tiny: Record<string, unknown> = await flood("tiny", (url) => tinyFlood(url));
  tiny.queue_file_mb = queueFileMb(path.join(root, "flood-tiny"));
  tiny.restart = await restartOn(servers, path.join(root, "flood-tiny"));
  progress("flood: 64 keys × 64 sessions of 8 KB announcements, then 5,000 keys of small ones, beside a live session");
  const roster = await flood("roster", (url) => rosterFlood(url));
  progress("flood: 1,000 connections ask for a 1.9 MB message and 1,000 for a 250 KB roster, and read nothing");
  const slow = await flood("slow", (url) => slowReadersFlood(url), true);
  return {
    announce,
    opaque_bytes: opaqueBytes,
    signed_bytes: signedBytes,
    signed_junk: junk,
    owners,
    bodies_in_flight: bodies,
    tiny_messages: tiny,
    roster,
    slow_readers: slow,
  };
}

/** Bytes of a bus's queue database (its data folder's queue.db and the WAL beside it), in MB. */
function queueFileMb(dataDir: string): number {
  const size = (f: string) => fs.existsSync(path.join(dataDir, f)) ? fs.statSync(path.join(dataDir, f)).size : 0;
  return Math.round((size("queue.db") + size("queue.db-wal")) / 1e5) / 10;
}

/** A signed recv of `route` by `id` with no wait: its status. */
async function provenRecv(url: string, id: Identity, route: string): Promise<number> {
  const ts = Date.now();
  const proof = `${ts}.${await id.sign(recvProofBytes(route, ts))}`;
  const r = await fetch(`${url}/recv?me=${encodeURIComponent(route)}&timeout_ms=0&proof=${proof}`);
  await r.body?.cancel();
  return r.status;
}

/**
 * Issue 34's ownership attack: the victim proves its route and has a message queued; one stranger's key proves
 * 100,001 routes of its own (`<key>#<i>`), then 2,000 fresh keys prove one route each. Whether an unproven recv
 * of the victim's route then gets its mail, the queue file's growth, and the same after a restart.
 */
async function ownersFlood(url: string, root: string): Promise<Record<string, unknown>> {
  const victim = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
  const route = `${victim.publicKey}#victim`;
  await provenRecv(url, victim, route);
  await postJson(`${url}/send`, { to: route, payload: { for: "the victim only" } });
  const dataDir = path.join(root, "flood-owners");
  const before = queueFileMb(dataDir);
  const eve = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
  const routes: Record<string, number> = {};
  const t0 = performance.now();
  for (let i = 0; i < 100_001; i += 100) {
    const got = await Promise.all(
      Array.from({ length: Math.min(100, 100_001 - i) }, (_, k) => provenRecv(url, eve, `${eve.publicKey}#${i + k}`)),
    );
    for (const s of got) routes[s] = (routes[s] ?? 0) + 1;
  }
  const routesSeconds = Math.round(performance.now() - t0) / 1000;
  const keys: Record<string, number> = {};
  for (let i = 0; i < 2_000; i += 50) {
    const got = await Promise.all(Array.from({ length: 50 }, async () => {
      const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
      return await provenRecv(url, id, id.publicKey);
    }));
    for (const s of got) keys[s] = (keys[s] ?? 0) + 1;
  }
  const stolen = await fetch(`${url}/recv?me=${encodeURIComponent(route)}&timeout_ms=0`);
  await stolen.body?.cancel();
  return {
    one_key_routes: routes,
    one_key_routes_seconds: routesSeconds,
    fresh_keys: keys,
    unproven_recv_of_the_victim: stolen.status,
    queue_file_mb_before: before,
    queue_file_mb_after: queueFileMb(dataDir),
  };
}

/**
 * Issue 34's bodies in flight: 1,000 connections each send the headers of a 2 MB /send and all of its body but
 * the last 100 bytes, then drip a space every 2 s for 20 s (past the idle and body timeouts). Answers before the
 * body ended, connections the bus closed, and the bus's RSS while they hold and 5 s after they close.
 */
async function bodiesFlood(url: string): Promise<Record<string, unknown>> {
  const { port } = new URL(url);
  const size = 2_000_000;
  const body = Buffer.alloc(size - 100, 0x20); // the rest comes a byte every 2 s
  body.write('{"to":"x","payload":"');
  let answered = 0, closed = 0;
  const sockets: net.Socket[] = [];
  await Promise.all(Array.from({ length: 1_000 }, () =>
    new Promise<void>((resolve) => {
      const s = net.connect(Number(port), "127.0.0.1", () => {
        s.write(`POST /send HTTP/1.1\r\nHost: x\r\nContent-Length: ${size}\r\n\r\n`);
        s.write(body, () => resolve());
      });
      let first = true;
      s.on("data", () => first && (first = false, answered++));
      s.on("error", () => resolve());
      s.on("close", () => (closed++, resolve()));
      sockets.push(s);
    })));
  const drip = setInterval(() => sockets.forEach((s) => s.destroyed || s.write(" ")), 2_000);
  await sleep(20_000);
  clearInterval(drip);
  const stillOpen = sockets.filter((s) => !s.destroyed).length;
  for (const s of sockets) s.destroy();
  return { connections: 1_000, body_bytes: size, answered, closed_by_the_bus: closed, open_after_20_s: stillOpen };
}

/** RSS of a bus 5 s after a flood's clients went away (what it let go of). */
async function rssAfterRest(pid: number): Promise<number | null> {
  await sleep(5_000);
  return rssMb(pid);
}

/**
 * Issue 34's tiny messages: 3,000,000 one-byte opaque payloads to 100,000 routes, 64 to a batched /send, 8
 * requests at a time. How many were taken, and the queue file's size.
 */
async function tinyFlood(url: string): Promise<Record<string, unknown>> {
  const statuses: Record<string, number> = {};
  let n = 0;
  const total = 3_000_000, batch = 64;
  let stopAt = Infinity; // once every message of 200 requests in a row is refused, the rest would be too
  let refusedRuns = 0;
  while (n < total && refusedRuns < stopAt) {
    const got = await Promise.all(Array.from({ length: 8 }, async () => {
      const messages = Array.from(
        { length: Math.min(batch, total - n) },
        () => ({ to: `r${n++ % 100_000}`, payload: 1 }),
      );
      if (!messages.length) return [];
      const r = await postJson(`${url}/send`, { messages }, 60_000);
      const body = await r.json() as { results?: { status: number }[] };
      return body.results?.map((x) => x.status) ?? [r.status];
    }));
    let taken = 0;
    for (const list of got) {
      for (const s of list) statuses[s] = (statuses[s] ?? 0) + 1;
      taken += list.filter((s) => s === 202).length;
    }
    refusedRuns = taken ? 0 : refusedRuns + 8;
    stopAt = 200;
  }
  return { tried: n, results: statuses, not_tried: total - n };
}

/** A bus restarted on the folder a flood left: its recovery line and how long to listening. */
async function restartOn(servers: Runtime | undefined, dataDir: string): Promise<Record<string, unknown>> {
  const t0 = performance.now();
  const bus = await startBus(servers, dataDir);
  try {
    const ms = Math.round(performance.now() - t0);
    await sleep(500); // the recovery line follows the listening one
    return {
      to_listening_ms: ms,
      recovered: bus.stderr.find((l) => l.includes("recovered")),
      rss_mb: rssMb(bus.child.pid!),
      queue_file_mb: queueFileMb(dataDir),
    };
  } finally {
    await stopChild(bus.child);
  }
}

/**
 * Issue 34's roster flood: a live session that announces every 5 s; 64 fresh keys × 64 sessions of about 8 KB
 * announcements; then 5,000 keys with one small announcement each. After each, whether the live session is
 * listed, the roster's size, and what one client's read of it costs (readRoster: fetch and verify).
 */
async function rosterFlood(url: string): Promise<Record<string, unknown>> {
  const real = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
  const session = (id: string, summary = "") => ({ session_id: id, cwd: "/home/real/project", git_root: "", summary });
  const announceReal = async () => {
    const r = await postJson(`${url}/announce`, await signAnnouncement(real, "real", Date.now(), session("live")));
    await r.body?.cancel();
  };
  await announceReal();
  const refresh = setInterval(() => void announceReal().catch(() => {}), 5_000);
  const snapshot = async () => {
    const text = await (await fetch(`${url}/roster`)).text();
    const cpu0 = process.cpuUsage();
    const { byRoute } = await readRoster([new HttpRelay(url)], Date.now());
    const cpu = process.cpuUsage(cpu0);
    return {
      live_session_listed: byRoute.has(`${real.publicKey}#live`),
      entries: (JSON.parse(text).roster as unknown[]).length,
      roster_bytes: text.length,
      client_cpu_ms_per_read: Math.round((cpu.user + cpu.system) / 1000),
    };
  };
  try {
    const big: Record<string, number> = {};
    const pad = "x".repeat(7_600);
    for (let k = 0; k < 64; k++) {
      const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
      const got = await Promise.all(Array.from({ length: 64 }, async (_, i) => {
        const a = await signAnnouncement(id, `k${k}`, Date.now(), { ...session(`s${i}`), cwd: pad });
        const r = await postJson(`${url}/announce`, a);
        await r.body?.cancel();
        return r.status;
      }));
      for (const s of got) big[s] = (big[s] ?? 0) + 1;
    }
    const afterBig = await snapshot();
    const small: Record<string, number> = {};
    for (let i = 0; i < 5_000; i += 100) {
      const got = await Promise.all(Array.from({ length: 100 }, async (_, j) => {
        const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
        const r = await postJson(`${url}/announce`, await signAnnouncement(id, `n${i + j}`, Date.now(), session("s")));
        await r.body?.cancel();
        return r.status;
      }));
      for (const s of got) small[s] = (small[s] ?? 0) + 1;
    }
    const afterSmall = await snapshot();
    return { big_announcements: big, after_big: afterBig, small_announcements: small, after_small: afterSmall };
  } finally {
    clearInterval(refresh);
  }
}

/**
 * Slow readers: a roster as long as one address may make it (4 keys × 64 sessions of about 1 KB) and a 1.9 MB
 * message on a route nobody owns; then 1,000 connections ask for the message and 1,000 for the roster, read the
 * status line and nothing more, and hold for 10 s before they close. Answers by status, and whether the message is
 * whole for a reader after them.
 */
async function slowReadersFlood(url: string): Promise<Record<string, unknown>> {
  for (let k = 0; k < 4; k++) {
    const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
    await Promise.all(Array.from({ length: 64 }, async (_, i) => {
      const session = { session_id: `s${i}`, cwd: `/${"p".repeat(700)}`, git_root: "", summary: "" };
      const r = await postJson(`${url}/announce`, await signAnnouncement(id, `k${k}`, Date.now(), session));
      await r.body?.cancel();
    }));
  }
  const rosterBytes = (await (await fetch(`${url}/roster`)).text()).length;
  await (await postJson(`${url}/send`, { to: "slow", payload: "x".repeat(1_900_000) })).body?.cancel();
  const { port } = new URL(url);
  const answers: Record<string, number> = {};
  const sockets: net.Socket[] = [];
  for (let i = 0; i < 2_000; i++) {
    const s = net.connect(Number(port), "127.0.0.1");
    s.on("error", () => {});
    s.once("data", (d) => {
      const status = `${i % 2 ? "roster" : "recv"} ${d.toString("latin1").slice(9, 12)}`;
      answers[status] = (answers[status] ?? 0) + 1;
      s.pause();
    });
    s.write(`GET ${i % 2 ? "/roster" : "/recv?me=slow&timeout_ms=0"} HTTP/1.1\r\nHost: x\r\n\r\n`);
    sockets.push(s);
  }
  await sleep(10_000);
  for (const s of sockets) s.destroy();
  const after = await fetch(`${url}/recv?me=slow&timeout_ms=0`);
  const whole = after.status === 200 && (await after.json()).envelope?.payload?.length === 1_900_000;
  return { roster_bytes: rosterBytes, message_bytes: 1_900_000, answers, message_whole_after: whole };
}

/**
 * Our bus and NATS JetStream side by side, in one run, under the same load
 * (relayLoad): 8 pairs × 500 messages, durable at both ends. Without
 * nats-server on PATH, says so and how to install it.
 */
async function benchRelays(root: string, progress: (m: string) => void, id: Identity, servers: Runtime | undefined) {
  const pairs = 8, perPair = 500;
  const out: Record<string, unknown> = { load: `${pairs} pairs × ${perPair}, send → recv → journal fdatasync → ack` };
  const bus = await startBus(servers, path.join(root, "relays-bus"));
  try {
    progress(`relays: our bus (${runtimeName()}), ${pairs} pairs × ${perPair}`);
    out.bus = await relayLoad(
      new HttpRelay(bus.url),
      id,
      path.join(root, "relays-bus-in"),
      bus.child.pid!,
      pairs,
      perPair,
    );
  } finally {
    await stopChild(bus.child);
  }
  const nats = await startNatsServer(path.join(root, "relays-nats"));
  if (!nats) {
    out.nats = "skipped: nats-server is not on PATH (install it with: sudo apt-get install -y nats-server)";
    return out;
  }
  const relay = new NatsRelay(nats.url, (data) => id.sign(data), id.publicKey);
  try {
    progress(`relays: NATS JetStream (nats-server pid ${nats.child.pid}), the same load`);
    out.nats = await relayLoad(relay, id, path.join(root, "relays-nats-in"), nats.child.pid!, pairs, perPair);
  } finally {
    await relay.close();
    await stopChild(nats.child);
  }
  const b = out.bus as { msgs_per_s: number }, n = out.nats as { msgs_per_s: number };
  out.nats_over_bus_throughput = Math.round((n.msgs_per_s / b.msgs_per_s) * 100) / 100;
  return out;
}

// -- footprint ----------------------------------------------------------------

/** Runs of each footprint figure; the report gives their median. */
const FOOTPRINT_RUNS = 3;
/** How long an `mcp` session idles before its RSS and idle CPU are read. */
const IDLE_MS = 10_000;
/** What Claude Code's Stop hook hands `wait` on stdin. */
const HOOK_JSON = JSON.stringify({ session_id: "s1", hook_event_name: "Stop", stop_hook_active: false });
/** A line of ordinary chat, for the day of use (the journals grow by what real messages would add). */
const CHAT_TEXT = "a line of ordinary chat text, ".repeat(3);

/**
 * The timers a live, idle `mcp` session runs, with their periods, as read from interlink.ts (at c4a6404): runMcp,
 * and the loops that Agent.startSending and Agent.startReceiving start (one of each per configured bus). Kept by
 * hand: a change there needs one here. The runtime's own timers and HTTP keep-alive are not ours and not listed.
 */
const MCP_TIMERS = [
  {
    timer: "runMcp: setTimeout(open, OPEN_AFTER_MS)",
    every_ms: null,
    once_after_ms: 500,
    why: "opens the session once, half a second after `initialized`; not while idle",
  },
  {
    timer: "Agent.startSending: setInterval(follow, FOLLOW_RECHECK_MS)",
    every_ms: 5_000,
    why: "re-reads log.jsonl behind fs.watch, which can miss a change (every 1 s where fs.watch cannot be had)",
  },
  {
    timer: "Agent.#receiptLoop: #owed.wait(ANNOUNCE_EVERY_MS)",
    every_ms: ANNOUNCE_EVERY_MS,
    why: "idle, sleeps until receipts are owed; then a pass a second (RECEIPT_EVERY_MS) while any are owed",
  },
  {
    timer: "Agent.#recvLoop, own route: HttpRelay.recv",
    every_ms: RECV_TIMEOUT_MS,
    why: "a long-poll the bus holds up to RECV_TIMEOUT_MS and answers at once when a message comes (abort timer +15 s)",
  },
  {
    timer: "Agent.#recvLoop, bare key (#bareKeyLoop)",
    every_ms: RECV_TIMEOUT_MS,
    why: "the same for the key itself, in the one session that holds bare.lock; any other retries the lock every 30 s",
  },
  {
    timer: "Agent.#announceLoop: pause(ANNOUNCE_EVERY_MS)",
    every_ms: ANNOUNCE_EVERY_MS,
    why: "signed presence on the bus's roster (a session is live for 90 s after one)",
  },
  {
    timer: "Agent.#endedLoop: pause(ENDED_EVERY_MS)",
    every_ms: 30_000,
    why: "drains and adopts this key's ended sessions, and rolls the journal over once it is past 1 MiB",
  },
  {
    timer: "Agent.#sendLoop: #outbox.wait(60_000)",
    every_ms: 60_000,
    why: "an empty outbox sleeps until a send wakes it; 60 s is a re-check (a failing bus: back-off instead)",
  },
];

/** The same for a blocked `wait` (runWait). */
const WAIT_TIMERS = [
  {
    timer: "runWait: wake.wait(Math.min(left, FOLLOW_RECHECK_MS))",
    every_ms: 5_000,
    why:
      "re-reads wait.pid, checks its server is there, catches up on log.jsonl; fs.watch on the folder wakes it sooner",
  },
];

/** A node of the footprint part: a fresh key, peers.json, state root and config.json under `root/name`. */
interface FootNode {
  name: string;
  key: string;
  peers: string;
  state: string;
  config: string;
  id: Identity;
}

async function footNode(root: string, name: string): Promise<FootNode> {
  const dir = path.join(root, name);
  const seed = crypto.getRandomValues(new Uint8Array(32));
  writeKeyFile(path.join(dir, "id.key"), seed, false);
  return {
    name,
    key: path.join(dir, "id.key"),
    peers: path.join(dir, "peers.json"),
    state: path.join(dir, "state"),
    config: path.join(dir, "config.json"), // never this machine's own settings
    id: await identityFromSeed(seed),
  };
}

/** Two nodes that know each other by the petnames `aName` and `bName`. */
async function pairNodes(a: FootNode, aName: string, b: FootNode, bName: string): Promise<void> {
  await addPeer(a.peers, bName, b.id.publicKey);
  await addPeer(b.peers, aName, a.id.publicKey);
}

/**
 * `interlink.ts mcp` of `node` (session s1) under `runtime`, driven by the SDK client: the time from spawn to the
 * answer of the first tools/list, and to its "ready" line (the session open: its journal folded, announced,
 * polling), which comes at least OPEN_AFTER_MS (500 ms) after `initialized`.
 */
async function startFootSession(cwd: string, node: FootNode, runtime: Runtime, busUrl: string, channel = false) {
  let openedAt = 0;
  const env = childEnv({
    INTERLINK_KEY: node.key,
    INTERLINK_PEERS: node.peers,
    INTERLINK_STATE: node.state,
    INTERLINK_CONFIG: node.config,
    INTERLINK_URL: busUrl,
    INTERLINK_NAME: node.name,
    INTERLINK_SESSION: "s1",
    ...(channel ? { INTERLINK_DELIVERY: "channel" } : {}), // else the plugin's default, inbox
  });
  const t0 = performance.now();
  const session = await McpSession.start(node.name, [...scriptArgv(runtime, INTERLINK), "mcp"], env, {
    cwd,
    onStderr: (line) => {
      if (!openedAt && / info: ready: /.test(line)) openedAt = performance.now();
    },
  });
  await session.client.listTools();
  const listMs = performance.now() - t0;
  await session.waitStderr(/ info: ready: /, 30_000);
  return { session, listMs: Math.round(listMs), openMs: Math.round(openedAt - t0) };
}

/**
 * The medians of a process's runs: its start (`${start}_ms`, and as a ratio to the bare runtime's), `also`, its RSS
 * (and as a ratio to the bare runtime's) and idle CPU; the runs themselves beside them.
 */
function footSummary(
  runs: Record<string, number | null>[],
  bare: { start: number; rss: number },
  start: string,
  also: string,
) {
  const m = (k: string) => median(runs.map((x) => x[k]));
  return {
    [`${start}_ms`]: m(`${start}_ms`),
    [`${start}_over_bare_start`]: ratio(m(`${start}_ms`), bare.start),
    [also]: m(also),
    rss_mb: m("rss_mb"),
    rss_over_bare: ratio(m("rss_mb"), bare.rss),
    idle_cpu_percent: m("idle_cpu_percent"),
    runs,
  };
}

/** SIGTERM to a session's server, as when Claude Code restarts it; resolves once the process is gone. */
async function killSession(session: McpSession): Promise<void> {
  const pid = session.pid!;
  process.kill(pid, "SIGTERM");
  for (const deadline = Date.now() + 10_000; Date.now() < deadline; await sleep(10)) {
    try {
      process.kill(pid, 0);
    } catch {
      break; // gone
    }
  }
  await session.close();
}

/** A bare runtime idling, `bun -e` or `deno eval` (which print one line first): spawn → that line, and RSS after 2 s. */
async function bareRuntime(runtime: Runtime, cwd: string) {
  const code = "console.log('up');setInterval(()=>{},1e9)";
  const t0 = performance.now();
  const child = spawn(runtimeBinary(runtime), runtime === "deno" ? ["eval", code] : ["-e", code], {
    stdio: ["ignore", "pipe", "ignore"],
    cwd,
    env: childEnv({}),
  });
  try {
    await untilSays(child, child.stdout!, "up", `bare ${runtime}`);
    const startMs = Math.round(performance.now() - t0);
    await sleep(2000);
    return { start_ms: startMs, rss_mb: rssMb(child.pid!) };
  } finally {
    await stopChild(child);
  }
}

/**
 * `interlink.ts wait` as the Stop hook runs it, the hook's JSON on stdin, on session s1 of `node`, under `runtime`.
 * Resolves once it has written wait.pid (it does so just before it starts waiting: `pidFileMs`) and its main thread
 * has then been still for 30 ms (`quietMs`: it reads the journal after writing wait.pid, which on a long journal is
 * the larger part); `exited` resolves with its exit code, stderr and when it exited. `more`: flags added.
 */
async function startWait(runtime: Runtime, node: FootNode, cwd: string, more: string[] = []) {
  const pidFile = path.join(node.state, "sessions", "s1", "wait.pid");
  fs.rmSync(pidFile, { force: true });
  const env = childEnv({ INTERLINK_CONFIG: node.config });
  delete env.CLAUDE_PID; // under a one-shot `claude -p` (this bench may run in one), wait exits at once
  const [cmd, ...pre] = scriptArgv(runtime, INTERLINK);
  const flags = ["--state", node.state, "--key", node.key, "--peers", node.peers, "--timeout", "600", ...more];
  const args = [...pre, "wait", ...flags];
  const t0 = performance.now();
  const child = spawn(cmd, args, { stdio: ["pipe", "ignore", "pipe"], cwd, env });
  child.stdin!.end(HOOK_JSON);
  let stderr = "";
  child.stderr!.on("data", (d: Buffer) => stderr += d.toString());
  let exitedAt = 0;
  child.once("exit", () => exitedAt = performance.now());
  const exited = new Promise<{ code: number | null; at: number; stderr: string }>((resolve) =>
    child.once("close", (code: number | null) => resolve({ code, at: exitedAt || performance.now(), stderr }))
  );
  while (!fs.existsSync(pidFile)) {
    if (child.exitCode !== null || performance.now() - t0 > 30_000) {
      await stopChild(child);
      throw new InterlinkError(`wait (${runtime}) did not start waiting (exit ${child.exitCode}): ${stderr}`);
    }
    await sleep(1);
  }
  const pidFileMs = performance.now() - t0;
  let cpu = mainThreadCpuNs(child.pid!), changed = performance.now();
  while (cpu !== null && performance.now() - changed < 30) {
    await sleep(2);
    const now = mainThreadCpuNs(child.pid!);
    if (now !== cpu) [cpu, changed] = [now, performance.now()];
  }
  return {
    child,
    exited,
    pidFileMs: Math.round(pidFileMs),
    quietMs: cpu === null ? null : Math.round(Math.max(changed, t0 + pidFileMs) - t0),
  };
}

/**
 * claude-peers-mcp measured as `mcp` is, when CLAUDE_PEERS_DIR names a checkout of it (with server.ts and broker.ts,
 * after `bun install` there): its broker started here, on a free port with its own database and HOME, so no daemon
 * of the machine's is used or left behind; then its server.ts, under Bun (it needs Bun), against it.
 */
async function benchClaudePeers(cwd: string, progress: (m: string) => void, bare: { start: number; rss: number }) {
  const dir = process.env.CLAUDE_PEERS_DIR;
  if (!dir || !fs.existsSync(path.join(dir, "server.ts"))) {
    return `skipped: ${
      dir ? `${dir} has no server.ts` : "CLAUDE_PEERS_DIR is not set"
    } (set it to a checkout of claude-peers-mcp after \`bun install\` in it: CLAUDE_PEERS_DIR=~/claude-peers-mcp bun dev/bench.ts --only footprint)`;
  }
  const home = path.join(cwd, "claude-peers-home");
  fs.mkdirSync(home, { recursive: true });
  const port = await freeLoopbackPort();
  const env = childEnv({ CLAUDE_PEERS_PORT: String(port), CLAUDE_PEERS_DB: path.join(home, "peers.db"), HOME: home });
  delete env.OPENAI_API_KEY; // its summaries would call out to the network
  const broker = spawn(runtimeBinary("bun"), [path.join(dir, "broker.ts")], {
    stdio: ["ignore", "ignore", "pipe"],
    cwd: dir,
    env,
  });
  try {
    for (let up = false, deadline = Date.now() + 15_000; !up; await sleep(100)) {
      if (broker.exitCode !== null || Date.now() > deadline) {
        throw new InterlinkError(`claude-peers broker.ts did not answer /health on port ${port}`);
      }
      up = await fetch(`http://127.0.0.1:${port}/health`).then((r) => r.ok, () => false);
    }
    progress(`footprint: claude-peers-mcp (${dir}), its server.ts ${FOOTPRINT_RUNS} runs after a warm-up`);
    const runs = [];
    for (let i = 0; i <= FOOTPRINT_RUNS; i++) {
      const t0 = performance.now();
      const session = await McpSession.start(
        `claude-peers-${i}`,
        [runtimeBinary("bun"), path.join(dir, "server.ts")],
        env,
        {
          cwd,
        },
      );
      try {
        await session.client.listTools();
        const listMs = Math.round(performance.now() - t0);
        if (i === 0) continue; // the warm-up
        const pid = session.pid!, cpu0 = cpuSeconds(pid), t = performance.now();
        await sleep(IDLE_MS);
        runs.push({
          first_tools_list_ms: listMs,
          rss_mb: rssMb(pid),
          idle_cpu_percent: cpuPercent(cpu0, cpuSeconds(pid), performance.now() - t),
        });
      } finally {
        await session.close();
      }
    }
    const list = median(runs.map((r) => r.first_tools_list_ms)), rss = median(runs.map((r) => r.rss_mb));
    return {
      first_tools_list_ms: list,
      first_tools_list_over_bare_start: ratio(list, bare.start),
      rss_mb: rss,
      rss_over_bare: ratio(rss, bare.rss),
      idle_cpu_percent: median(runs.map((r) => r.idle_cpu_percent)),
      broker_rss_mb: rssMb(broker.pid!),
      runs,
    };
  } finally {
    await stopChild(broker);
  }
}

/**
 * Footprint, in one run against one bus: the bare runtimes; `mcp` and `wait` under Bun and Deno (start, RSS, idle
 * CPU: medians of FOOTPRINT_RUNS, as ratios to the bare runtime); wait's wake latency beside channel push;
 * claude-peers-mcp when installed; a day of use (`messages` from one agent to another, the receiver in channel
 * mode: RSS after, as a ratio to the same sessions fresh, every message once, the journals' roll-overs, and the
 * receiver's restart on its journal beside a fresh start); and the timers an idle session runs.
 */
async function benchFootprint(
  root: string,
  progress: (m: string) => void,
  servers: Runtime | undefined,
  messages: number,
) {
  const runtimes: Runtime[] = ["bun", "deno"];
  const cwd = path.join(root, "footprint");
  fs.mkdirSync(cwd, { recursive: true });
  const out: Record<string, unknown> = {
    load_avg_before: loadAverage(),
    binaries: Object.fromEntries(runtimes.map((r) => [r, runtimeBinary(r)])),
  };
  const bus = await startBus(servers, path.join(root, "footprint-bus"));
  const sessions: McpSession[] = [];
  try {
    // -- the bare runtimes, round-robin so the machine's noise falls on both
    progress(`footprint: bare Bun and Deno, ${FOOTPRINT_RUNS} runs each: spawn → first line, RSS after 2 s`);
    const bareRuns: Record<Runtime, { start_ms: number; rss_mb: number | null }[]> = { bun: [], deno: [] };
    for (let i = 0; i < FOOTPRINT_RUNS; i++) for (const r of runtimes) bareRuns[r].push(await bareRuntime(r, cwd));
    const bare = Object.fromEntries(runtimes.map((r) => [r, {
      start: median(bareRuns[r].map((x) => x.start_ms))!,
      rss: median(bareRuns[r].map((x) => x.rss_mb))!,
    }])) as Record<Runtime, { start: number; rss: number }>;
    out.bare = Object.fromEntries(
      runtimes.map((r) => [r, { start_ms: bare[r].start, rss_mb: bare[r].rss, runs: bareRuns[r] }]),
    );

    // -- mcp: spawn → first tools/list, then a live idle session
    progress(
      `footprint: mcp under Bun and Deno, ${FOOTPRINT_RUNS} runs each after a warm-up: spawn → first tools/list, ${
        IDLE_MS / 1000
      } s idle once open`,
    );
    const mcpRuns: Record<Runtime, Record<string, number | null>[]> = { bun: [], deno: [] };
    for (let i = 0; i <= FOOTPRINT_RUNS; i++) {
      for (const r of runtimes) {
        const s = await startFootSession(cwd, await footNode(cwd, `mcp-${r}-${i}`), r, bus.url);
        try {
          if (i === 0) continue; // the warm-up: Deno's module cache, the SDK client's import
          const pid = s.session.pid!, cpu0 = cpuSeconds(pid), t = performance.now();
          await sleep(IDLE_MS);
          mcpRuns[r].push({
            first_tools_list_ms: s.listMs,
            session_open_ms: s.openMs,
            rss_mb: rssMb(pid),
            idle_cpu_percent: cpuPercent(cpu0, cpuSeconds(pid), performance.now() - t),
          });
        } finally {
          await s.session.close();
        }
      }
    }
    out.mcp = Object.fromEntries(
      runtimes.map((r) => [r, footSummary(mcpRuns[r], bare[r], "first_tools_list", "session_open_ms")]),
    );

    // -- wait, as the Stop hook runs it, on a session folder its server made
    progress(`footprint: wait under Bun and Deno, ${FOOTPRINT_RUNS} runs each: spawn → blocked, RSS, idle CPU`);
    const waitRuns: Record<Runtime, Record<string, number | null>[]> = { bun: [], deno: [] };
    for (let i = 0; i < FOOTPRINT_RUNS; i++) {
      for (const r of runtimes) {
        const node = await footNode(cwd, `wait-${r}-${i}`);
        fs.mkdirSync(path.join(node.state, "sessions", "s1"), { recursive: true });
        const w = await startWait(r, node, cwd);
        try {
          await sleep(2000);
          const pid = w.child.pid!, rss = rssMb(pid), cpu0 = cpuSeconds(pid), t = performance.now();
          await sleep(5000);
          const cpu = cpuPercent(cpu0, cpuSeconds(pid), performance.now() - t);
          if (w.child.exitCode !== null) throw new InterlinkError(`wait (${r}) stopped waiting: ${w.child.exitCode}`);
          waitRuns[r].push({ wait_pid_ms: w.pidFileMs, quiet_ms: w.quietMs, rss_mb: rss, idle_cpu_percent: cpu });
        } finally {
          await stopChild(w.child);
        }
      }
    }
    out.wait = Object.fromEntries(runtimes.map((r) => [r, footSummary(waitRuns[r], bare[r], "wait_pid", "quiet_ms")]));

    out.claude_peers = await benchClaudePeers(cwd, progress, bare.bun);

    // -- wake: a peer's message until `wait` exits 2, beside send → channel push, interleaved
    const warm = 3, count = 20;
    progress(
      `footprint: ${count} messages (after ${warm} to warm up) each: send → push, send → wait exits 2 (Bun, Deno)`,
    );
    const [alice, bob, carol] = await Promise.all(["alice", "bob", "carol"].map((n) => footNode(cwd, n)));
    await pairNodes(alice, "alice", bob, "bob");
    await pairNodes(alice, "alice", carol, "carol");
    const [a, b, c] = await Promise.all([
      startFootSession(cwd, alice, OWN_RUNTIME, bus.url),
      startFootSession(cwd, bob, OWN_RUNTIME, bus.url), // inbox, as the plugin ships: its wait shows the messages
      startFootSession(cwd, carol, OWN_RUNTIME, bus.url, true),
    ]);
    sessions.push(a.session, b.session, c.session);
    const push: number[] = [], wakes: Record<Runtime, number[]> = { bun: [], deno: [] };
    for (let n = 0; n < warm + count; n++) {
      const t0 = performance.now();
      const pushed = c.session.waitEvent((e) => e.content.includes(`#${n}#`), 20_000).then(() => performance.now());
      await a.session.ok("send_message", { to: "carol", text: `push #${n}#` });
      if (n >= warm) push.push((await pushed) - t0);
      await pushed;
      for (const r of runtimes) {
        const w = await startWait(r, bob, cwd);
        const t1 = performance.now();
        await a.session.ok("send_message", { to: "bob", text: `wake ${r} #${n}#` });
        const done = await Promise.race([w.exited, sleep(30_000).then(() => null)]);
        if (!done || done.code !== 2 || !done.stderr.includes(`#${n}#`)) {
          await stopChild(w.child);
          throw new InterlinkError(`wait (${r}) did not wake with message ${n}: ${JSON.stringify(done)}`);
        }
        if (n >= warm) wakes[r].push(done.at - t1);
      }
    }
    for (const list of [push, wakes.bun, wakes.deno]) list.sort((x, y) => x - y);
    const pushP50 = percentile(push, 50);
    out.wake = {
      messages: count,
      channel_push_ms_p50: pushP50,
      ...Object.fromEntries(runtimes.flatMap((r) => [
        [`wait_${r}_wake_ms_p50`, percentile(wakes[r], 50)],
        [`wait_${r}_wake_ms_max`, percentile(wakes[r], 100)],
        [`wait_${r}_wake_over_push`, ratio(percentile(wakes[r], 50), pushP50)],
      ])),
      note: `mcp sessions under ${runtimeName()}; a wait is started and blocked before each message is sent`,
    };
    await Promise.allSettled(sessions.splice(0).map((s) => s.close()));

    const freshWait = Object.fromEntries(runtimes.map((r) => [r, median(waitRuns[r].map((x) => x.rss_mb))])) as Record<
      Runtime,
      number | null
    >;
    out.day = await dayOfUse(
      cwd,
      progress,
      bus,
      messages,
      median(mcpRuns[OWN_RUNTIME].map((x) => x.rss_mb)),
      freshWait,
      sessions,
    );
    out.mcp_timers = MCP_TIMERS;
    out.wait_timers = WAIT_TIMERS;
    out.timers_under_5_s = [...MCP_TIMERS, ...WAIT_TIMERS]
      .filter((t) => t.every_ms !== null && t.every_ms < 5000)
      .map((t) => `${t.timer}: every ${t.every_ms} ms`);
    out.load_avg_after = loadAverage();
    return out;
  } finally {
    await Promise.allSettled(sessions.map((s) => s.close()));
    await stopChild(bus.child);
  }
}

/**
 * A day of use: a sender and a receiver (channel mode), fresh and paired, under this runtime; the sender calls
 * send_message `messages` times, awaiting each (the product's flow control paces it: past SEND_WINDOW unconfirmed
 * the rest wait in its outbox). Every message must arrive once (counted by content). Then both RSS against the same
 * sessions fresh, the journals' roll-overs, the receiver killed and restarted on its journal FOOTPRINT_RUNS times
 * beside as many fresh starts, and wait blocking on that journal.
 */
async function dayOfUse(
  cwd: string,
  progress: (m: string) => void,
  bus: { url: string; child: ReturnType<typeof spawn> },
  messages: number,
  freshMcpRss: number | null,
  freshWaitRss: Record<Runtime, number | null>,
  sessions: McpSession[],
) {
  const [sender, receiver] = await Promise.all([footNode(cwd, "day-sender"), footNode(cwd, "day-receiver")]);
  await pairNodes(sender, "sender", receiver, "receiver");
  const [s, r0] = await Promise.all([
    startFootSession(cwd, sender, OWN_RUNTIME, bus.url),
    startFootSession(cwd, receiver, OWN_RUNTIME, bus.url, true),
  ]);
  sessions.push(s.session, r0.session);
  let r = r0;
  await sleep(IDLE_MS);
  const before = { sender: rssMb(s.session.pid!), receiver: rssMb(r.session.pid!), bus: rssMb(bus.child.pid!) };
  progress(`footprint: a day of use, ${messages} messages sender → receiver (channel), each send_message awaited`);
  const arrived = new Map<number, number>(); // message number → times pushed
  const count = (events: { content: string }[], from: number) => {
    for (let i = from; i < events.length; i++) {
      const m = events[i].content.match(/^day #(\d+)#/);
      if (m) arrived.set(Number(m[1]), (arrived.get(Number(m[1])) ?? 0) + 1);
    }
    return events.length;
  };
  // Their RSS as the day goes, in the progress lines: whether it levels off shows what is bounded.
  const rssNow = () => `RSS sender ${rssMb(s.session.pid!)} MB, receiver ${rssMb(r.session.pid!)} MB`;
  const t0 = performance.now();
  for (let n = 0; n < messages; n++) {
    await s.session.ok("send_message", { to: "receiver", text: `day #${n}# ${CHAT_TEXT}` });
    if ((n + 1) % 1000 === 0) progress(`footprint: ${n + 1} sent, ${r.session.events.length} pushed; ${rssNow()}`);
  }
  const sentS = (performance.now() - t0) / 1000;
  let seen = 0, lastGain = Date.now(), said = Date.now();
  for (let had = -1; Date.now() - lastGain < 60_000;) { // stalled a minute: the rest is counted lost
    seen = count(r.session.events, seen);
    if (arrived.size >= messages) break;
    if (arrived.size !== had) [had, lastGain] = [arrived.size, Date.now()];
    if (Date.now() - said > 10_000) {
      progress(`footprint: ${arrived.size} of ${messages} pushed; ${rssNow()}`);
      said = Date.now();
    }
    await sleep(200);
  }
  const allS = (performance.now() - t0) / 1000;
  await sleep(2000); // a duplicate has a moment to show up
  seen = count(r.session.events, seen);
  await sleep(IDLE_MS);
  const after = { sender: rssMb(s.session.pid!), receiver: rssMb(r.session.pid!), bus: rssMb(bus.child.pid!) };
  // A journal rolls only when its checkpoint (what the state carries and remembers) is under half of the file:
  // the checkpoint's size and its longest lists tell why one did not.
  const journals = (node: FootNode) => {
    const dir = path.join(node.state, "sessions", "s1");
    const files = fs.readdirSync(dir);
    const log = fs.readFileSync(path.join(dir, "log.jsonl"), "utf8");
    const first = log.slice(0, log.indexOf("\n") + 1);
    let checkpoint: Record<string, number> | null = null;
    if (/^\{"t":"checkpoint"/.test(first)) {
      const c = JSON.parse(first) as Record<string, Record<string, unknown>>;
      checkpoint = { kb: Math.round(Buffer.byteLength(first) / 1024) };
      for (const group of ["carried", "remembered"]) {
        for (const [k, v] of Object.entries(c[group] ?? {})) {
          if (Array.isArray(v) && v.length) checkpoint[`${group}.${k}`] = v.length;
        }
      }
    }
    return {
      archives: files.filter((f) => /^log-\d+\.jsonl$/.test(f)).length,
      log_jsonl_kb: Math.round(Buffer.byteLength(log) / 1024),
      checkpoint,
      total_mb: Math.round(
        files.filter((f) => /^log(-\d+)?\.jsonl$/.test(f))
          .reduce((n, f) => n + fs.statSync(path.join(dir, f)).size, 0) / 1e5,
      ) / 10,
    };
  };
  const journalsAfter = { sender: journals(sender), receiver: journals(receiver) };

  progress(`footprint: the receiver killed (SIGTERM) and restarted on its journal, beside fresh starts`);
  const restarts: { first_tools_list_ms: number; session_open_ms: number }[] = [];
  const fresh: { first_tools_list_ms: number; session_open_ms: number }[] = [];
  let repushed = 0;
  for (let i = 0; i < FOOTPRINT_RUNS; i++) {
    await killSession(r.session);
    sessions.splice(sessions.indexOf(r.session), 1);
    r = await startFootSession(cwd, receiver, OWN_RUNTIME, bus.url, true);
    sessions.push(r.session);
    restarts.push({ first_tools_list_ms: r.listMs, session_open_ms: r.openMs });
    const f = await startFootSession(cwd, await footNode(cwd, `day-fresh-${i}`), OWN_RUNTIME, bus.url, true);
    fresh.push({ first_tools_list_ms: f.listMs, session_open_ms: f.openMs });
    await f.session.close();
    await sleep(1000); // anything it wrongly pushes again shows up
    repushed += r.session.events.filter((e) => /^day #\d+#/.test(e.content)).length;
  }
  await sleep(IDLE_MS);
  const restartedRss = rssMb(r.session.pid!);
  progress(`footprint: wait blocking on the day's journal (receiver's session, live), ${FOOTPRINT_RUNS} runs each`);
  const waitOnDay: Record<Runtime, { wait_pid_ms: number; quiet_ms: number | null; rss_mb: number | null }[]> = {
    bun: [],
    deno: [],
  };
  for (let i = 0; i < FOOTPRINT_RUNS; i++) {
    for (const rt of ["bun", "deno"] as const) {
      // --delivery inbox: the receiver's config.json says channel (its mcp wrote it), where wait has nothing to do.
      const w = await startWait(rt, receiver, cwd, ["--delivery", "inbox"]);
      await sleep(2000);
      waitOnDay[rt].push({ wait_pid_ms: w.pidFileMs, quiet_ms: w.quietMs, rss_mb: rssMb(w.child.pid!) });
      await stopChild(w.child);
    }
  }
  const med = <T>(list: T[], k: keyof T) => median(list.map((x) => x[k] as number | null));
  const dupes = [...arrived.values()].reduce((n, k) => n + k - 1, 0);
  return {
    runtime: runtimeName(),
    messages,
    arrived: arrived.size,
    lost: messages - arrived.size,
    duplicated: dupes,
    send_loop_s: Math.round(sentS * 10) / 10,
    all_arrived_s: Math.round(allS * 10) / 10,
    msgs_per_s: Math.round(arrived.size / allS),
    rss_mb_fresh: before,
    rss_mb_after: after,
    sender_rss_over_fresh: ratio(after.sender, before.sender),
    receiver_rss_over_fresh: ratio(after.receiver, before.receiver),
    bus_rss_over_fresh: ratio(after.bus, before.bus),
    fresh_mcp_rss_mb: freshMcpRss,
    journals_after: journalsAfter,
    journals_after_restarts: { sender: journals(sender), receiver: journals(receiver) },
    receiver_restart: {
      first_tools_list_ms: med(restarts, "first_tools_list_ms"),
      session_open_ms: med(restarts, "session_open_ms"),
      fresh_first_tools_list_ms: med(fresh, "first_tools_list_ms"),
      fresh_session_open_ms: med(fresh, "session_open_ms"),
      first_tools_list_over_fresh: ratio(med(restarts, "first_tools_list_ms"), med(fresh, "first_tools_list_ms")),
      session_open_over_fresh: ratio(med(restarts, "session_open_ms"), med(fresh, "session_open_ms")),
      rss_mb_after_restart: restartedRss,
      rss_after_restart_over_fresh: ratio(restartedRss, before.receiver),
      day_messages_pushed_again: repushed,
      restarts,
      fresh,
    },
    wait_on_days_journal: Object.fromEntries((["bun", "deno"] as const).map((rt) => [rt, {
      wait_pid_ms: med(waitOnDay[rt], "wait_pid_ms"),
      quiet_ms: med(waitOnDay[rt], "quiet_ms"),
      rss_mb: med(waitOnDay[rt], "rss_mb"),
      fresh_wait_rss_mb: freshWaitRss[rt],
      rss_over_fresh_wait: ratio(med(waitOnDay[rt], "rss_mb"), freshWaitRss[rt]),
      runs: waitOnDay[rt],
    }])),
  };
}

// -- backlog ------------------------------------------------------------------

/** Messages appended to the backlog sender's journal in one write, as `interlink.ts send` would, many at a time. */
const BACKLOG_BATCH = 1000;

/**
 * A backlog: a session whose relay is down (nothing listens on its bus's port) gets `count` messages queued
 * into its journal by another process, in batches under the inbox lock, as `interlink.ts send` queues them beside
 * a running server; the session folds them as they land. Its RSS (peak while they land, and after IDLE_MS idle) is
 * compared with the same session fresh, before; list_pending and message_status answer on the backlog; then the
 * session is restarted on that journal (RSS again), the bus comes up on that port with a live peer (channel
 * mode), and the backlog drains: every message must arrive once, in the order it was queued.
 */
async function benchBacklog(root: string, progress: (m: string) => void, servers: Runtime | undefined, count: number) {
  const cwd = path.join(root, "backlog");
  fs.mkdirSync(cwd, { recursive: true });
  const [sender, receiver] = await Promise.all([footNode(cwd, "sender"), footNode(cwd, "receiver")]);
  await pairNodes(sender, "sender", receiver, "receiver");
  const port = await freeLoopbackPort();
  const url = `http://127.0.0.1:${port}`;
  const busDir = path.join(root, "backlog-bus");
  const sessions: McpSession[] = [];
  let bus: { url: string; child: ReturnType<typeof spawn> } | null = null;
  const out: Record<string, unknown> = { runtime: runtimeName(), messages: count, load_avg_before: loadAverage() };
  try {
    // One message through first, so the sender knows the receiver confirms by receipts: its flow control then
    // holds the drain at SEND_WINDOW unconfirmed, as it would between two of our nodes that have talked before.
    bus = await startBus(servers, busDir, [], port);
    let s = await startFootSession(cwd, sender, OWN_RUNTIME, url);
    let r = await startFootSession(cwd, receiver, OWN_RUNTIME, url, true);
    sessions.push(s.session, r.session);
    const hello = await s.session.ok("send_message", { to: "receiver", text: "hello" });
    const helloId = hello.match(/msg_id (\w+)/)![1];
    for (const deadline = Date.now() + 30_000; Date.now() < deadline; await sleep(100)) {
      if (/delivered/.test(await s.session.ok("message_status", { msg_id: helloId }))) break;
    }
    await stopChild(bus.child); // the relay goes down; nothing listens on its port until the drain
    bus = null;
    await r.session.close();
    sessions.splice(sessions.indexOf(r.session), 1);
    await sleep(IDLE_MS);
    const fresh = rssMb(s.session.pid!);
    progress(`backlog: the sender fresh, ${fresh} MB; ${count} messages queued while its relay is down`);
    const dir = path.join(sender.state, "sessions", "s1");
    const journal = new Journal(dir, new NodeState());
    let peak = fresh ?? 0;
    const sample = setInterval(() => peak = Math.max(peak, rssMb(s.session.pid!) ?? 0), 100);
    const t0 = performance.now();
    const ids: string[] = [];
    try {
      for (let n = 0; n < count;) {
        const records: NewRecord[] = [];
        for (const end = Math.min(count, n + BACKLOG_BATCH); n < end; n++) {
          const draft = { to: receiver.id.publicKey, text: `backlog #${n}# ${CHAT_TEXT}` };
          const msg = await signMessage(sender.id, draft, Date.now());
          ids.push(msg.msg_id);
          records.push({ t: "out", peer: "receiver", recipient: receiver.id.publicKey, msg });
        }
        await withFileLock(path.join(dir, "inbox"), "interlink send", () => journal.append(records));
        await journal.sync();
        if (n % 10_000 === 0) progress(`backlog: ${n} queued; the sender at ${rssMb(s.session.pid!)} MB`);
      }
      journal.close();
      // Folded by the session once message_status knows the last one.
      const last = ids[ids.length - 1];
      for (const deadline = Date.now() + 120_000; Date.now() < deadline; await sleep(200)) {
        if (!(await s.session.call("message_status", { msg_id: last })).isError) break;
      }
    } finally {
      clearInterval(sample);
    }
    const queuedS = (performance.now() - t0) / 1000;
    await sleep(IDLE_MS);
    const live = rssMb(s.session.pid!);
    const timed = async (name: string, args: Record<string, unknown> = {}) => {
      const t = performance.now();
      const text = await s.session.ok(name, args);
      return { ms: Math.round(performance.now() - t), kb: Math.round(Buffer.byteLength(text) / 1024), text };
    };
    const pending = await timed("list_pending");
    const first = await timed("message_status", { msg_id: ids[0] });
    const afterTools = rssMb(s.session.pid!);
    const logFiles = fs.readdirSync(dir).filter((f) => /^log(-\d+)?\.jsonl$/.test(f));
    const journalMb = logFiles.reduce((n, f) => n + fs.statSync(path.join(dir, f)).size, 0) / 1e6;

    progress(`backlog: the sender restarted on that journal (SIGTERM, then a new mcp)`);
    await killSession(s.session);
    sessions.splice(sessions.indexOf(s.session), 1);
    s = await startFootSession(cwd, sender, OWN_RUNTIME, url);
    sessions.push(s.session);
    await sleep(IDLE_MS);
    const restarted = rssMb(s.session.pid!);
    const restart = { first_tools_list_ms: s.listMs, session_open_ms: s.openMs };

    progress(`backlog: the bus comes up on port ${port} with the receiver (channel); the backlog drains`);
    bus = await startBus(servers, busDir, [], port);
    r = await startFootSession(cwd, receiver, OWN_RUNTIME, url, true);
    sessions.push(r.session);
    let drainPeak = restarted ?? 0;
    const order: number[] = [];
    let seen = 0, lastGain = Date.now(), said = Date.now();
    const t1 = performance.now();
    while (Date.now() - lastGain < 60_000) { // stalled a minute: the rest is counted lost
      drainPeak = Math.max(drainPeak, rssMb(s.session.pid!) ?? 0);
      const before = order.length;
      for (; seen < r.session.events.length; seen++) {
        const m = r.session.events[seen].content.match(/^backlog #(\d+)#/);
        if (m) order.push(Number(m[1]));
      }
      if (order.length > before) lastGain = Date.now();
      if (new Set(order).size >= count) break;
      if (Date.now() - said > 10_000) {
        progress(`backlog: ${order.length} of ${count} arrived; the sender at ${rssMb(s.session.pid!)} MB`);
        said = Date.now();
      }
      await sleep(200);
    }
    const drainS = (performance.now() - t1) / 1000;
    await sleep(IDLE_MS);
    const drained = rssMb(s.session.pid!);
    const distinct = new Set(order).size;
    out.sender = {
      rss_mb_fresh: fresh,
      queued_s: Math.round(queuedS * 10) / 10,
      rss_mb_peak_while_queued: peak,
      rss_mb_with_backlog: live,
      rss_with_backlog_over_fresh: ratio(live, fresh),
      peak_while_queued_over_fresh: ratio(peak, fresh),
      journal_mb: Math.round(journalMb * 10) / 10,
      list_pending: { ms: pending.ms, kb: pending.kb, first_line: pending.text.split("\n")[0] },
      message_status_of_the_first: { ms: first.ms, text: first.text },
      rss_mb_after_those_tools: afterTools,
      rss_after_tools_over_fresh: ratio(afterTools, fresh),
      restart,
      rss_mb_restarted: restarted,
      rss_restarted_over_fresh: ratio(restarted, fresh),
    };
    out.drain = {
      arrived: distinct,
      lost: count - distinct,
      duplicated: order.length - distinct,
      out_of_order: order.filter((n, i) => i > 0 && n < order[i - 1]).length,
      drain_s: Math.round(drainS * 10) / 10,
      msgs_per_s: Math.round(distinct / drainS),
      sender_rss_mb_peak: drainPeak,
      sender_peak_over_fresh: ratio(drainPeak, fresh),
      sender_rss_mb_after: drained,
      sender_after_over_fresh: ratio(drained, fresh),
    };
    out.load_avg_after = loadAverage();
    return out;
  } finally {
    await Promise.allSettled(sessions.map((x) => x.close()));
    if (bus) await stopChild(bus.child);
  }
}

// ============================================================================
// main
// ============================================================================

async function runBench(o: BenchOptions): Promise<number> {
  const progress = (m: string) => process.stderr.write(`bench: ${m}\n`);
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "interlink-bench-"));
  const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
  const sample = await signMessage(id, {
    to: id.publicKey,
    text: "Install the deps and restart ComfyUI, then report back with the versions you ended up with.",
    task_id: "bench",
    status: "update",
  }, Date.now());
  const report: Record<string, unknown> = {
    runtime: runtimeName(),
    interlink: VERSION,
    cpus: os.cpus().length,
    load_avg_before: loadAverage(),
  };
  const only = o.parts, servers = o.servers;
  try {
    if (only.includes("throughput")) report.throughput = await benchThroughput(root, progress, sample, id, servers);
    if (only.includes("recovery")) report.bus_recovery = await benchRecovery(root, progress, sample, servers);
    if (only.includes("idle")) report.bus_idle_long_poll = await benchIdle(root, progress, servers);
    if (only.includes("agents")) report.agents = await benchAgents(root, progress, servers);
    if (only.includes("sessions")) report.sessions = await benchSessions(root, progress, servers);
    if (only.includes("idle-sessions")) report.idle_sessions = await benchIdleSessions(root, progress, servers);
    if (only.includes("flood")) report.floods = await benchFlood(root, progress, servers);
    if (only.includes("relays")) report.relays = await benchRelays(root, progress, id, servers);
    if (only.includes("footprint")) report.footprint = await benchFootprint(root, progress, servers, o.messages);
    if (only.includes("backlog")) report.backlog = await benchBacklog(root, progress, servers, o.backlog);
    if (only.includes("seal")) report.seal = await benchSeal(root, progress, servers);
  } finally {
    fs.rmSync(root, { recursive: true, force: true });
  }
  report.load_avg_after = loadAverage();
  print(JSON.stringify(report, null, 2));
  return 0;
}

export async function main(argv: string[]): Promise<number> {
  try {
    const o = parseOptions(argv);
    if (o.help) {
      print(USAGE);
      return 0;
    }
    return o.serveFloor ? await serveFloor() : await runBench(o);
  } catch (e) {
    if (e instanceof InterlinkError) {
      process.stderr.write(`bench: ${e.message}\n`);
      return 1;
    }
    throw e;
  }
}

if (import.meta.main) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (e) => {
      process.stderr.write(`bench: ${(e as Error).stack ?? e}\n`);
      process.exit(70);
    },
  );
}
