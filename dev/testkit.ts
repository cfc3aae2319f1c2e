// The suite's shared kit: what more than one test file needs (the core's tests in interlink.test.ts, each extra's
// beside it). Identities from the signing vectors, temporary folders and the children a test starts (all swept after
// each file: see sweepAfterAll), the CLI run as a child under Bun or Deno, buses, nats-server processes, nodes' files
// and MCP sessions, their journals read back, waiting helpers. Bun only (it drives bun:test and Bun.spawn): deno check
// leaves it out, as it does the tests.

import { afterAll, expect, test } from "bun:test";
import { spawn, spawnSync } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import {
  type Announcement,
  b64urlDecode,
  type Identity,
  identityFromSeed,
  type NodeConfig,
  type PushEvent,
  readJsonl,
  recvProofBytes,
  setLogSink,
  writeKeyFile,
} from "../interlink.ts";
import { Bus, serveHttp } from "../bus.ts";
import { McpSession } from "./harness.ts";

/** The repository's root: this file is in its dev/. */
export const REPO = path.dirname(import.meta.dir);
export const SCRIPT = path.join(REPO, "interlink.ts");
export const DENO_VERSION = "2.9.6";

export const VECTORS_TEXT = fs.readFileSync(path.join(REPO, "vectors", "v2.json"), "utf8");
export const VECTORS = JSON.parse(VECTORS_TEXT);

// Everything a test starts is also registered here, so that a failed assertion
// never leaves a process running, a folder behind or a tmpfs mounted: the
// afterAll that sweepAfterAll registers kills each child's whole process group and removes the rest.
export const made = { dirs: new Set<string>(), pids: new Set<number>(), mounts: new Set<string>() };

export function tmpDir(prefix = "interlink-test-"): string {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), prefix));
  made.dirs.add(dir);
  return dir;
}

/** Kills a child's process group (children are spawned detached, so they lead one), else the child alone. */
export function killGroup(pid: number, signal: NodeJS.Signals = "SIGKILL"): void {
  for (const target of [-pid, pid]) {
    try {
      process.kill(target, signal);
      return;
    } catch {
      // no such group (not detached) or already gone
    }
  }
}

/** Bun.spawn in a process group of its own, registered for the final sweep. */
export function spawnTracked(
  argv: string[],
  opts: {
    stdin?: "ignore";
    stdout?: "pipe" | "ignore";
    stderr?: "pipe" | "ignore";
    env?: Record<string, string | undefined>;
  } = {},
) {
  // Typed as piped: callers read only the streams they asked for.
  const proc = Bun.spawn(argv, { cwd: REPO, ...opts, detached: true } as never) as Bun.Subprocess<
    "ignore",
    "pipe",
    "pipe"
  >;
  made.pids.add(proc.pid);
  return proc;
}

// The library logs to stderr as a server should; here its lines are kept, and
// shown only with INTERLINK_TEST_VERBOSE=1, so a passing run prints nothing.
export const logged: string[] = [];
setLogSink((line) => {
  if (process.env.INTERLINK_TEST_VERBOSE) process.stderr.write(line);
  logged.push(line);
  if (logged.length > 2000) logged.splice(0, 1000);
});

/**
 * Called once at the top of every test file, before its tests. Bun runs the files one after another in one process
 * and evaluates this module once, for the first of them: a hook registered here would run after that file alone, so
 * each file registers its own. It gives the file a config.json of its own (no test reads or writes this machine's
 * real one: the server writes one on its first start), and after the file's last test kills every child it started,
 * unmounts its tmpfs and removes its folders: a few hundred, which on a loaded disk take longer than a hook's default
 * 5 s (the run then failed as "(unnamed)" although every test passed).
 */
export function sweepAfterAll(): void {
  process.env.INTERLINK_CONFIG = path.join(tmpDir("interlink-test-config-"), "config.json");
  afterAll(() => {
    for (const pid of made.pids) killGroup(pid);
    for (const dir of made.mounts) spawnSync("umount", ["-l", dir]);
    for (const dir of made.dirs) fs.rmSync(dir, { recursive: true, force: true });
    // The next file starts with nothing to sweep but its own.
    made.pids.clear();
    made.mounts.clear();
    made.dirs.clear();
  }, 120_000);
}

/** Sleeps until a wall-clock time: for tests whose subject is a timeout. */
export const sleepUntil = (ms: number) => new Promise((r) => setTimeout(r, Math.max(0, ms - Date.now())));

/** Waits for `check` to hold, re-checking every 20 ms, and fails with `what` after `ms`: no test orders events by sleeping. */
export async function eventually(check: () => boolean | Promise<boolean>, what: string, ms = 15_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting until ${what}`);
    await Bun.sleep(20);
  }
}

/** The Deno binary: $INTERLINK_TEST_DENO, `deno` on PATH, or the pinned npm package via npx. */
let denoPathCache: string | undefined;
export function denoPath(): string {
  if (denoPathCache) return denoPathCache;
  const fromEnv = process.env.INTERLINK_TEST_DENO || Bun.which("deno");
  if (fromEnv) return (denoPathCache = fromEnv);
  const r = spawnSync("npx", ["-y", `deno@${DENO_VERSION}`, "eval", "console.log(Deno.execPath())"], {
    encoding: "utf8",
  });
  if (r.status !== 0) throw new Error(`cannot get Deno ${DENO_VERSION} through npx: ${r.stderr}`);
  return (denoPathCache = r.stdout.trim().split("\n").at(-1)!);
}

// Deno fetches the SDK's npm graph on its first run (it prefetches dynamic
// imports with literal specifiers): ~10 s on a cold cache, and much more when
// several cold processes race for it. Fetch it once, here, so no test's timing
// includes a cold cache.
{
  const r = spawnSync(denoPath(), ["install", "--quiet", "--entrypoint", SCRIPT, path.join(REPO, "dev", "demo.ts")], {
    cwd: REPO,
    encoding: "utf8",
    timeout: 300_000,
  });
  if (r.status !== 0) {
    throw new Error(`cannot prepare Deno's cache (deno install --entrypoint): ${r.stderr || r.error}`);
  }
}

/** An executable on PATH, or where Debian puts it (/usr/sbin, which a user's PATH may lack), else null. */
export function findTool(name: string, debianPath: string): string | null {
  return Bun.which(name) ?? (fs.existsSync(debianPath) ? debianPath : null);
}

/**
 * A system tool some tests need (a Debian package, which CI installs): its path, on PATH or where Debian puts it, or
 * null, after saying which tests are skipped and the line that installs it.
 */
export function systemTool(name: string, debianPath: string, group: string, tests: string[]): string | null {
  const found = findTool(name, debianPath);
  if (!found) {
    process.stderr.write(
      `\nSKIPPED ${tests.length} ${group} tests (${name} is not on PATH):\n${
        tests.map((t) => `  - ${t}\n`).join("")
      }Install it with: sudo apt-get install -y ${name}\n\n`,
    );
  }
  return found;
}

/** A loopback port free when asked (a neighbouring test may still take it before it is bound). */
export function freePort(): Promise<number> {
  const server = Bun.serve({ port: 0, fetch: () => new Response() });
  const port = server.port!;
  server.stop(true);
  return Promise.resolve(port);
}

/** Copies `files` (paths in the repository) into `dir` at the same paths: beside interlink.ts, where it looks for them. */
export function copyFromRepo(dir: string, ...files: string[]): void {
  for (const f of files) {
    fs.mkdirSync(path.dirname(path.join(dir, f)), { recursive: true });
    fs.copyFileSync(path.join(REPO, f), path.join(dir, f));
  }
}

/** A folder holding what a clone of the repository runs from (interlink.ts, bus.ts, nats.ts, extras/, dev/), no node_modules. */
export function cloneLike(prefix: string): string {
  const dir = tmpDir(prefix);
  copyFromRepo(dir, "interlink.ts", "bus.ts", "nats.ts");
  for (const sub of ["extras", "dev"]) fs.cpSync(path.join(REPO, sub), path.join(dir, sub), { recursive: true });
  return dir;
}

/** argv prefix that runs interlink.ts under the named runtime. */
export function runtimeArgv(runtime: "bun" | "deno", script = SCRIPT): string[] {
  return runtime === "bun" ? [process.execPath, script] : [denoPath(), "run", "-A", "--quiet", script];
}

export function runCli(
  runtime: "bun" | "deno",
  args: string[],
  opts: { input?: string; env?: Record<string, string> } = {},
) {
  const [cmd, ...pre] = runtimeArgv(runtime);
  const r = spawnSync(cmd, [...pre, ...args], {
    input: opts.input,
    encoding: "utf8",
    env: { ...process.env, ...opts.env },
    cwd: REPO,
    timeout: 60_000,
    maxBuffer: 64 << 20, // a log with a 2 MB message in it
  });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

/**
 * spawnSync's result without blocking the test runner, so the slow child-process tests marked
 * `test.concurrent` overlap. The child leads its own process group and is swept like the others.
 */
export function spawnAsync(
  cmd: string,
  args: string[],
  opts: { cwd?: string; env?: Record<string, string | undefined>; input?: string; timeout?: number } = {},
): Promise<{ status: number | null; stdout: string; stderr: string }> {
  const child = spawn(cmd, args, { cwd: opts.cwd ?? REPO, env: opts.env ?? process.env, detached: true });
  made.pids.add(child.pid!);
  let stdout = "", stderr = "";
  child.stdout.setEncoding("utf8").on("data", (d) => stdout += d);
  child.stderr.setEncoding("utf8").on("data", (d) => stderr += d);
  child.stdin.end(opts.input ?? "");
  const timer = setTimeout(() => killGroup(child.pid!), opts.timeout ?? 60_000);
  return new Promise((resolve) =>
    child.on("close", (status) => {
      clearTimeout(timer);
      resolve({ status, stdout, stderr });
    })
  );
}

/** runCli without blocking (see spawnAsync). */
export async function runCliAsync(
  runtime: "bun" | "deno",
  args: string[],
  opts: { env?: Record<string, string> } = {},
) {
  const [cmd, ...pre] = runtimeArgv(runtime);
  const r = await spawnAsync(cmd, [...pre, ...args], { env: { ...process.env, ...opts.env } });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

export const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");

export const ALICE = VECTORS.keys.alice;
export const BOB = VECTORS.keys.bob;
export const EVE = VECTORS.keys.eve;

export const alice: Identity = await identityFromSeed(b64urlDecode(ALICE.secret_b64, 32, "seed"));
export const bob: Identity = await identityFromSeed(b64urlDecode(BOB.secret_b64, 32, "seed"));
export const eve: Identity = await identityFromSeed(b64urlDecode(EVE.secret_b64, 32, "seed"));

// ----------------------------------------------------------------------------
// Asking a bus

/** True when a bus holds nothing un-acked for `me` (a recv with no wait answers timeout). */
export async function busDrained(busUrl: string, me: string | NodeFiles): Promise<boolean> {
  // A node's files: its bare key and its session's route (tests name the session after the node).
  const routes = typeof me === "string" ? [me] : [me.id.publicKey, `${me.id.publicKey}#${me.name}`];
  for (const route of routes) {
    // A node's own route has proven its key to our bus: reading it takes a proof, as the node's own recv does.
    const ts = Date.now();
    const proof = typeof me === "string" ? "" : `&proof=${ts}.${await me.id.sign(recvProofBytes(route, ts))}`;
    const r = await (await fetch(`${busUrl}/recv?me=${encodeURIComponent(route)}&timeout_ms=0${proof}`)).json();
    if (r.status !== "timeout") return false;
  }
  return true;
}

/** True once the bus lists a session of this node (its session opens shortly after the client's `initialized`). */
export async function onRoster(busUrl: string, f: NodeFiles): Promise<boolean> {
  const { roster } = await (await fetch(`${busUrl}/roster`)).json();
  return roster.some((a: Announcement) => a.pubkey === f.id.publicKey);
}

export async function postSend(busUrl: string, to: string, payload: unknown) {
  const r = await fetch(`${busUrl}/send`, { method: "POST", body: JSON.stringify({ to, payload }) });
  expect(r.status).toBe(202);
}

/** A peak and current resident size of a process, in bytes (Linux /proc). */
export function memoryOf(pid: number): { rss: number; peak: number } {
  const status = fs.readFileSync(`/proc/${pid}/status`, "utf8");
  const kb = (name: string) => Number(status.match(new RegExp(`${name}:\\s+(\\d+)`))![1]) * 1024;
  return { rss: kb("VmRSS"), peak: kb("VmHWM") };
}

// ----------------------------------------------------------------------------
// A full disk, played by a small tmpfs (bus.test.ts and interlink.test.ts)

/** Mounts a small tmpfs (root only); null, with the reason printed once, where mounting is not permitted. */
export function smallDisk(kb: number): { dir: string; unmount(): void } | null {
  const dir = tmpDir("interlink-tmpfs-");
  const r = spawnSync("mount", ["-t", "tmpfs", "-o", `size=${kb}k`, "tmpfs", dir], { encoding: "utf8" });
  if (r.status !== 0) return null;
  made.mounts.add(dir);
  return { dir, unmount: () => void spawnSync("umount", ["-l", dir]) };
}

/** A full disk is played by a small tmpfs, which only root may mount: without it these tests are skipped, and say so. */
export const CAN_MOUNT = (() => {
  const probe = smallDisk(64);
  probe?.unmount();
  if (!probe) {
    process.stderr.write(
      "SKIPPED the disk-full tests (they mount a small tmpfs, which needs root): run the suite as root to include them\n",
    );
  }
  return probe !== null;
})();
export const diskTest = test.skipIf(!CAN_MOUNT);

/** Fills a disk to its last few KB with one file; removing the file gives the space back. */
export function fillDisk(dir: string, leaveBytes: number): string {
  const filler = path.join(dir, "filler");
  const fd = fs.openSync(filler, "w");
  const block = Buffer.alloc(4096, 0x61);
  try {
    for (;;) {
      const free = fs.statfsSync(dir).bavail * fs.statfsSync(dir).bsize;
      if (free <= leaveBytes) break;
      fs.writeSync(fd, block, 0, Math.min(block.length, free - leaveBytes));
    }
  } catch {
    // full
  } finally {
    fs.closeSync(fd);
  }
  return filler;
}

// ----------------------------------------------------------------------------
// Helpers for processes

export interface Child {
  proc: ReturnType<typeof Bun.spawn>;
  stderr: string[];
  /** Resolves with the first stderr line matching `re`. */
  waitFor(re: RegExp, ms?: number): Promise<RegExpMatchArray>;
}

export function spawnChild(argv: string[], env: Record<string, string> = {}): Child {
  const proc = spawnTracked(argv, {
    stdin: "ignore",
    stdout: "ignore",
    stderr: "pipe",
    env: { ...process.env, ...env },
  });
  const lines: string[] = [];
  const watchers: { re: RegExp; resolve(m: RegExpMatchArray): void }[] = [];
  (async () => {
    const decoder = new TextDecoder();
    let buf = "";
    for await (const chunk of proc.stderr as ReadableStream<Uint8Array>) {
      buf += decoder.decode(chunk);
      let nl;
      while ((nl = buf.indexOf("\n")) !== -1) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        lines.push(line);
        if (process.env.INTERLINK_TEST_VERBOSE) process.stderr.write(`  [child ${proc.pid}] ${line}\n`);
        for (const w of watchers.splice(0)) {
          const m = line.match(w.re);
          if (m) w.resolve(m);
          else watchers.push(w);
        }
      }
    }
  })();
  return {
    proc,
    stderr: lines,
    waitFor(re, ms = 30_000) {
      for (const line of lines) {
        const m = line.match(re);
        if (m) return Promise.resolve(m);
      }
      return new Promise((resolve, reject) => {
        const timer = setTimeout(
          () => reject(new Error(`no stderr line matched ${re} within ${ms} ms; got:\n${lines.join("\n")}`)),
          ms,
        );
        watchers.push({ re, resolve: (m) => (clearTimeout(timer), resolve(m)) });
      });
    },
  };
}

export async function startBus(
  runtime: "bun" | "deno",
  dataDir: string,
  extra: string[] = [],
  env: Record<string, string> = {},
): Promise<Child & { url: string }> {
  const child = spawnChild([...runtimeArgv(runtime), "bus", "--port", "0", "--data", dataDir, ...extra], env);
  const m = await Promise.race([
    child.waitFor(/listening on (http:\/\/\S+)/),
    child.proc.exited.then((code) => {
      throw new Error(`bus exited with ${code}:\n${child.stderr.join("\n")}`);
    }),
  ]);
  return { ...child, url: m[1] };
}

export async function stop(child: Child, signal: NodeJS.Signals = "SIGTERM") {
  killGroup(child.proc.pid, signal);
  await child.proc.exited;
}

// ----------------------------------------------------------------------------
// Helpers for agents: a real `interlink.ts mcp` child driven by the SDK client

export interface NodeFiles {
  name: string;
  dir: string;
  keyFile: string;
  peersFile: string;
  stateDir: string;
  id: Identity;
}

export async function makeNodeFiles(root: string, name: string): Promise<NodeFiles> {
  const dir = path.join(root, name);
  fs.mkdirSync(dir, { recursive: true });
  const seed = crypto.getRandomValues(new Uint8Array(32));
  const keyFile = path.join(dir, "id.key");
  writeKeyFile(keyFile, seed, false);
  return {
    name,
    dir,
    keyFile,
    peersFile: path.join(dir, "peers.json"),
    stateDir: path.join(dir, "state"),
    id: await identityFromSeed(seed),
  };
}

/** An in-process node's configuration for these files. */
export function nodeConfig(f: NodeFiles, busUrls: string[], delivery: NodeConfig["delivery"] = "channel"): NodeConfig {
  return {
    keyFile: f.keyFile,
    peersFile: f.peersFile,
    busUrls,
    name: f.name,
    stateDir: f.stateDir,
    delivery,
    session: f.name,
  };
}

/** alice and bob, each with a key, peers of each other, in a fresh folder. */
export async function twoPeers(): Promise<{ root: string; A: NodeFiles; B: NodeFiles }> {
  const root = tmpDir();
  const A = await makeNodeFiles(root, "alice");
  const B = await makeNodeFiles(root, "bob");
  befriend(A, B);
  return { root, A, B };
}

export function befriend(a: NodeFiles, b: NodeFiles) {
  for (const [me, other] of [[a, b], [b, a]]) {
    const peers = fs.existsSync(me.peersFile) ? JSON.parse(fs.readFileSync(me.peersFile, "utf8")) : {};
    peers[other.name] = { key: other.id.publicKey };
    fs.writeFileSync(me.peersFile, JSON.stringify(peers));
  }
}

/** A real `interlink.ts mcp` child for one node's files, driven by the SDK client (`script`: another copy of the file). */
export type McpNode = McpSession;
export const McpNode = {
  start(
    runtime: "bun" | "deno",
    files: NodeFiles,
    busUrl: string,
    env: Record<string, string> = {},
    script = SCRIPT,
  ): Promise<McpSession> {
    return McpSession.start(files.name, [...runtimeArgv(runtime, script), "mcp"], {
      INTERLINK_KEY: files.keyFile,
      INTERLINK_PEERS: files.peersFile,
      INTERLINK_STATE: files.stateDir,
      INTERLINK_URL: busUrl,
      INTERLINK_NAME: files.name,
      INTERLINK_DELIVERY: "channel",
      INTERLINK_SESSION: files.name,
      INTERLINK_CONFIG: path.join(files.dir, "config.json"),
      INTERLINK_TEST_BACKOFF_MAX_MS: "1000", // a relay that comes back is found within a second, not up to 30 s later
      ...(process.env.DENO_DIR ? { DENO_DIR: process.env.DENO_DIR } : {}),
      ...(process.env.XDG_CACHE_HOME ? { XDG_CACHE_HOME: process.env.XDG_CACHE_HOME } : {}),
      ...env,
    }, {
      cwd: path.dirname(script),
      onStderr: (line) => process.env.INTERLINK_TEST_VERBOSE && process.stderr.write(`  [${files.name}] ${line}\n`),
    }).then((session) => {
      if (session.pid) made.pids.add(session.pid);
      return session;
    });
  },
};

/** The msg_id a tool's answer names. */
export const msgIdOf = (text: string) => text.match(/msg_id (\S+)/)![1];

/** An in-process bus served on a loopback port; `bus` itself can also play a relay that checks nothing. */
export async function busOnLoopback(dir: string, port = 0) {
  const bus = await Bus.open(dir, { log: () => {} });
  const server = await serveHttp(bus.handler, "127.0.0.1", port);
  const shutdown = async () => {
    await server.stop();
    await bus.close();
  };
  return { bus, server, url: `http://127.0.0.1:${server.port}`, shutdown };
}

/**
 * An in-process bus that answers every request 503 until `comeBack()`: a relay that is away, then back. `onRequest`
 * sees each request it serves once it is back.
 */
export async function busThatComesBack(dir: string, onRequest: (req: Request) => void = () => {}) {
  const bus = await Bus.open(dir, { log: () => {} });
  let up = false;
  const server = await serveHttp(
    async (req) => {
      if (!up) return new Response('{"error":"down"}', { status: 503 }); // the bus is away for now
      onRequest(req);
      return await bus.handler(req);
    },
    "127.0.0.1",
    0,
  );
  const shutdown = async () => {
    await server.stop();
    await bus.close();
  };
  return { bus, url: `http://127.0.0.1:${server.port}`, comeBack: () => void (up = true), shutdown };
}

// ----------------------------------------------------------------------------
// Helpers for answers: a child's lines, raw HTTP, what an error page must not show

/** Reads a child's stream until a line matches `re` (its first group is returned), then keeps draining it. */
export async function untilLine(stream: ReadableStream<Uint8Array>, re: RegExp, ms: number): Promise<string> {
  const lines: string[] = [];
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  const timer = setTimeout(() => reader.cancel(), ms);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error(`no line matched ${re} within ${ms} ms; got:\n${lines.join("\n")}`);
      buf += decoder.decode(value);
      const parts = buf.split("\n");
      buf = parts.pop()!;
      for (const line of parts) {
        lines.push(line);
        if (process.env.INTERLINK_TEST_VERBOSE) process.stderr.write(`  [child] ${line}\n`);
        const m = line.match(re);
        if (!m) continue;
        clearTimeout(timer);
        void (async () => {
          while (!(await reader.read().catch(() => ({ done: true }))).done); // a full pipe would stall the child
        })();
        return m[1];
      }
    }
  } finally {
    clearTimeout(timer);
  }
}

/** A raw HTTP/1.1 request, so a test can send the Host header a browser would never let a page choose. */
export function rawGet(port: number, target: string, headers: Record<string, string>): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = net.connect(port, "127.0.0.1");
    let answer = "";
    socket.on("data", (d) => (answer += d.toString()));
    socket.on("end", () => resolve(answer));
    socket.on("error", reject);
    // An answer that never ends (an event stream let through): what came in 3 s, rather than a hung test.
    setTimeout(() => (socket.destroy(), resolve(answer)), 3_000).unref();
    const head = Object.entries({ ...headers, connection: "close" }).map(([k, v]) => `${k}: ${v}\r\n`).join("");
    socket.write(`GET ${target} HTTP/1.1\r\n${head}\r\n`);
  });
}

/** What must never be in an answer to a stranger: where this runs, the source, the board's token. */
export const leaks = (answer: string, token: string) =>
  [REPO, "interlink.ts", "node_modules", token, "at "].filter((s) => answer.includes(s));

// ----------------------------------------------------------------------------
// The real Codex CLI (pinned, a dev dependency): codex-install's test (extras/codex.test.ts) and the core's Codex
// sessions (interlink.test.ts) run it.

/** The native codex binary the dev dependency installs, or null (then the Codex tests say so and are skipped). */
export const CODEX_BIN = (() => {
  const vendor = path.join(REPO, "node_modules", "@openai");
  for (const pkg of fs.existsSync(vendor) ? fs.readdirSync(vendor).filter((d) => d.startsWith("codex-")) : []) {
    const root = path.join(vendor, pkg, "vendor");
    for (const triple of fs.existsSync(root) ? fs.readdirSync(root) : []) {
      const bin = path.join(root, triple, "bin", "codex");
      if (fs.existsSync(bin)) return bin;
    }
  }
  return null;
})();
if (!CODEX_BIN) {
  process.stderr.write(
    "SKIPPED the Codex CLI tests (install, binding, wakes): @openai/codex is not installed. Install it with: npx -y bun@1.4.5 install\n",
  );
}
export const codexTest = test.skipIf(!CODEX_BIN);

// deno-lint-ignore no-explicit-any -- journal records of every kind, read back for assertions
export function readNodeLog(stateDir: string): any[] {
  // Every session's journal (tests run one session per node, named after it).
  const sessions = path.join(stateDir, "sessions");
  const files = fs.existsSync(sessions)
    ? fs.readdirSync(sessions).map((id) => path.join(sessions, id, "log.jsonl"))
    : [];
  return files.flatMap((f) => readJsonl(f));
}

/** msg_ids a node admitted, in journal order (duplicates would show twice). */
export const admittedIds = (f: NodeFiles): string[] =>
  readNodeLog(f.stateDir).filter((r) => r.t === "in").map((r) => r.msg.msg_id);

/** The channel event a node is pushed that matches `pred`, within 30 s. */
export const eventOn = (node: McpNode, pred: (e: PushEvent) => boolean) => node.waitEvent(pred, 30_000);

// -- NATS JetStream servers ----------------------------------------------------

/** nats-server, for the test files whose NATS tests run (each says which it skips without it: see systemTool). */
const NATS_BIN = findTool("nats-server", "/usr/sbin/nats-server");

export interface NatsServer {
  url: string;
  log: string;
  kill(): void;
}

/** True once something accepts TCP connections on the port. */
export const accepting = (port: number) =>
  new Promise<boolean>((resolve) => {
    const socket = net.connect(port, "127.0.0.1", () => (socket.destroy(), resolve(true)));
    socket.on("error", () => resolve(false));
  });

/**
 * Starts nats-server nodes with JetStream (one, or a cluster when n > 1) and waits until each accepts
 * connections (and a cluster has elected its JetStream leader). They log to a file, not a pipe.
 */
export async function startNats(
  root: string,
  n = 1,
  opts: { jetstream?: boolean; accounts?: object; port?: number } = {},
): Promise<NatsServer[]> {
  // A port found free can be taken by a neighbouring test before nats-server binds it: then again, other ports.
  for (let attempt = 1;; attempt++) {
    try {
      return await startNatsOnce(path.join(root, `try-${attempt}`), n, opts);
    } catch (e) {
      if (attempt === 3 || !/exited with/.test((e as Error).message)) throw e;
    }
  }
}

async function startNatsOnce(
  root: string,
  n: number,
  opts: { jetstream?: boolean; accounts?: object; port?: number },
): Promise<NatsServer[]> {
  const ports = await Promise.all(Array.from({ length: n * 2 }, () => freePort()));
  if (opts.port) ports[0] = opts.port; // a port the test chose (one a node is already told to use)
  const servers = Array.from({ length: n }, (_, i) => {
    const dir = path.join(root, `nats-${i}`);
    fs.mkdirSync(dir, { recursive: true });
    const log = path.join(dir, "nats.log");
    const routes = Array.from({ length: n }, (_, j) => `nats://127.0.0.1:${ports[n + j]}`).filter((_, j) => j !== i);
    const conf = [
      `listen: 127.0.0.1:${ports[i]}`,
      `server_name: n${i}`,
      `log_file: "${log}"`,
      "max_payload: 2MB",
      opts.jetstream === false ? "" : `jetstream { store_dir: "${dir}" }`,
      n > 1 ? `cluster { name: c, listen: 127.0.0.1:${ports[n + i]}, routes: [${routes.join(", ")}] }` : "",
      opts.accounts ? `accounts: ${JSON.stringify(opts.accounts)}` : "",
    ].join("\n");
    fs.writeFileSync(path.join(dir, "nats.conf"), conf);
    const proc = spawnTracked([NATS_BIN!, "-c", path.join(dir, "nats.conf")], {
      stdout: "ignore",
      stderr: "ignore",
    });
    return { url: `nats://127.0.0.1:${ports[i]}`, log, port: ports[i], proc, kill: () => killGroup(proc.pid) };
  });
  const logOf = (s: { log: string }) => (fs.existsSync(s.log) ? fs.readFileSync(s.log, "utf8") : "");
  const exited = () => servers.find((s) => s.proc.exitCode !== null);
  try {
    for (const s of servers) {
      await eventually(
        async () => {
          if (exited()) throw new Error(`nats-server exited with ${exited()!.proc.exitCode}:\n${logOf(exited()!)}`);
          // Its own word that it has bound every listener (a port that answers might be another process's).
          return /Server is ready/.test(logOf(s)) && await accepting(s.port);
        },
        `nats-server on port ${s.port} accepts connections`,
        30_000,
      );
    }
  } catch (e) {
    for (const s of servers) s.kill();
    throw e;
  }
  if (n > 1) {
    await eventually(
      () =>
        servers.some((s) =>
          /JetStream cluster new metadata leader|Self is new JetStream cluster metadata leader/.test(logOf(s))
        ),
      "the cluster elected its JetStream leader",
      30_000,
    );
  }
  return servers.map(({ url, log, kill }) => ({ url, log, kill }));
}

/** An MCP node on these relays, in inbox mode unless told otherwise. */
export const natsNode = (runtime: "bun" | "deno", f: NodeFiles, urls: string[], env: Record<string, string> = {}) =>
  McpNode.start(runtime, f, urls.join(","), {
    INTERLINK_DELIVERY: "inbox",
    INTERLINK_AUTOSTART_BUS: "0",
    INTERLINK_TEST_NATS_ACK_WAIT_MS: "2000", // an unacked message comes again after 2 s instead of 10 s
    ...env,
  });

/** Whether any file under `dir` holds `text`'s UTF-8 bytes (a relay's data folder: its database, its WAL, a stream). */
export function folderHolds(dir: string, text: string): boolean {
  const needle = Buffer.from(text);
  return fs.readdirSync(dir, { recursive: true, withFileTypes: true }).some((e) =>
    e.isFile() && fs.readFileSync(path.join(e.parentPath, e.name)).includes(needle)
  );
}

/**
 * Sealed mail through a relay, both ways, between a Bun node (alice) and a Deno node (bob): an operator's
 * `peers seal bob --required` holds alice's first message (bob's node has not said it opens sealed mail) and says
 * why; one message each way in the clear teaches each node, by the other's signed receipt, that the other opens them;
 * then each sends the other a task while the other is away, and the relay's data folder (`dataDir`) holds the
 * message (its msg_id) but none of its text or task fields; back, the other is shown it whole.
 */
export async function sealedBothWays(url: string, dataDir: string, env: Record<string, string> = {}): Promise<void> {
  const { A, B } = await twoPeers();
  const cli = (...args: string[]) => runCli("bun", ["peers", ...args, "--peers", A.peersFile]);
  const opens = (me: NodeFiles, other: NodeFiles) => () => {
    const file = path.join(me.stateDir, "seals.json");
    return fs.existsSync(file) && JSON.parse(fs.readFileSync(file, "utf8"))[other.id.publicKey]?.opens === true;
  };
  let alice = await McpNode.start("bun", A, url, env), bob = await McpNode.start("deno", B, url, env);
  try {
    expect(cli("seal", "bob", "--required").code).toBe(0);
    expect(cli().stdout).toContain("seal required");
    const held = await alice.call("send_message", { to: "bob", text: "not yet" });
    expect(held.isError).toBe(true);
    expect(held.text).toContain("bob is to be sent nothing in the clear (peers seal bob --required)");
    expect(cli("seal", "bob").code).toBe(0); // plain messages until bob's node says it opens sealed ones
    const hello = await alice.ok("send_message", { to: "bob", text: "hello in the clear" });
    await bob.waitEvent((e) => e.meta.msg_id === msgIdOf(hello), 30_000);
    await eventually(opens(A, B), "alice's node learns from bob's receipt that it opens sealed mail", 30_000);
    const back = await bob.ok("send_message", { to: "alice", text: "hi in the clear" });
    await alice.waitEvent((e) => e.meta.msg_id === msgIdOf(back), 30_000);
    await eventually(opens(B, A), "bob's node learns the same of alice's", 30_000);
    expect(cli("seal", "bob", "--required").code).toBe(0); // now nothing goes to bob in the clear, and it need not

    for (const [from, to, rt, files] of [["alice", "bob", "deno", B], ["bob", "alice", "bun", A]] as const) {
      const sender = from === "alice" ? alice : bob;
      await (from === "alice" ? bob : alice).close(); // the recipient is away: the message waits on the relay
      const secret = `the launch code for ${to} is ${crypto.randomUUID()}`, task = `task-${crypto.randomUUID()}`;
      const sent = msgIdOf(await sender.ok("send_message", { to, text: secret, task_id: task }));
      await eventually(() => folderHolds(dataDir, sent), `the relay holds ${from}'s message ${sent}`, 30_000);
      expect({ text: folderHolds(dataDir, secret), task_id: folderHolds(dataDir, task) }).toEqual({
        text: false,
        task_id: false,
      });
      const again = await McpNode.start(rt, files, url, env);
      if (from === "alice") bob = again;
      else alice = again;
      const shown = await again.waitEvent((e) => e.meta.msg_id === sent, 30_000);
      expect(shown.content).toBe(`[task ${task}] ${secret}`);
      expect(shown.meta.sender).toBe(from);
    }
  } finally {
    await Promise.allSettled([alice.close(), bob.close()]);
  }
}

// -- a scripted model for real Claude Code sessions ----------------------------------------------------------

/** The pinned Claude Code's native binary, or null when it is not installed. */
export const CLAUDE_BIN = (() => {
  // The platform package's native binary (Bun runs no postinstall, so claude-code's own bin/ keeps its stub).
  const root = path.join(REPO, "node_modules", "@anthropic-ai");
  for (const pkg of fs.existsSync(root) ? fs.readdirSync(root).filter((d) => d.startsWith("claude-code-")) : []) {
    const bin = path.join(root, pkg, "claude");
    if (fs.existsSync(bin) && fs.statSync(bin).size > 1_000_000) return bin;
  }
  return null;
})();

/** One content value as text: a string, or blocks (text, tool_result with its content, tool_use as JSON). */
export function contentText(content: unknown): string {
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return "";
  // deno-lint-ignore no-explicit-any -- API content blocks
  return content.map((b: any) =>
    b?.type === "text"
      ? b.text
      : b?.type === "tool_result"
      ? contentText(b.content)
      : b?.type === "tool_use"
      ? JSON.stringify(b.input)
      : ""
  ).join("\n");
}

export interface ModelRequest {
  session: string;
  // deno-lint-ignore no-explicit-any -- the request body as sent
  body: any;
  /** Everything after the last assistant message: what the model is newly shown. */
  latest: string;
  /** Tool names it was offered. */
  tools: string[];
  toolUse?: boolean;
}

export type ModelReply = { text: string } | { tool: string; input: unknown } | ((r: ModelRequest) => ModelReply);

/**
 * A scripted Anthropic Messages API: per session (the path prefix /s/<name>), rules tried in order against
 * what the model is newly shown; the first unused one that matches answers, else a short end_turn text. It
 * streams as the API does (message_start, content blocks, message_delta with stop_reason, message_stop) and
 * logs every request, so a test asserts exactly what each model was shown.
 */
export class FakeModel {
  readonly requests: ModelRequest[] = [];
  readonly url: string;
  #rules = new Map<string, { match: string | RegExp; reply: ModelReply; used: boolean; always: boolean }[]>();
  #waiters: { pred: (r: ModelRequest) => boolean; resolve(r: ModelRequest): void }[] = [];
  #server: ReturnType<typeof Bun.serve>;

  constructor() {
    this.#server = Bun.serve({ hostname: "127.0.0.1", port: 0, idleTimeout: 0, fetch: (req) => this.#handle(req) });
    this.url = `http://127.0.0.1:${this.#server.port}`;
  }

  baseUrl = (session: string) => `${this.url}/s/${session}`;

  /** When `session`'s model is newly shown `match`, it answers `reply` (once, or every time: `always`). */
  on(session: string, match: string | RegExp, reply: ModelReply, always = false): this {
    this.#rules.set(session, [...this.#rules.get(session) ?? [], { match, reply, used: false, always }]);
    return this;
  }

  of = (session: string) => this.requests.filter((r) => r.session === session);

  /** The first request (logged or to come) that satisfies `pred`. */
  waitFor(pred: (r: ModelRequest) => boolean, what: string, ms = 30_000): Promise<ModelRequest> {
    const hit = this.requests.find(pred);
    if (hit) return Promise.resolve(hit);
    return new Promise((resolve, reject) => {
      const seen = () =>
        this.requests.map((r) => `  [${r.session}] ${r.latest.replace(/\s+/g, " ").slice(-300)}`).join("\n");
      const timer = setTimeout(
        () => reject(new Error(`the fake model saw no request where ${what} within ${ms} ms; it saw:\n${seen()}`)),
        ms,
      );
      this.#waiters.push({ pred, resolve: (r) => (clearTimeout(timer), resolve(r)) });
    });
  }

  stop = () => this.#server.stop(true);

  async #handle(req: Request): Promise<Response> {
    const m = new URL(req.url).pathname.match(/^\/s\/([^/]+)(\/.*)$/);
    if (!m || req.method !== "POST" || m[2] !== "/v1/messages") {
      return Response.json({ type: "error", error: { type: "not_found_error", message: "fake: no such route" } }, {
        status: 404,
      });
    }
    const body = await req.json();
    // deno-lint-ignore no-explicit-any -- the request's messages
    const msgs: any[] = body.messages ?? [];
    let i = msgs.length - 1;
    while (i >= 0 && msgs[i].role !== "assistant") i--;
    const r: ModelRequest = {
      session: m[1],
      body,
      latest: msgs.slice(i + 1).map((x) => contentText(x.content)).join("\n"),
      // deno-lint-ignore no-explicit-any -- tool definitions
      tools: (body.tools ?? []).map((t: any) => t.name),
    };
    const rule = r.tools.length
      ? this.#rules.get(r.session)?.find((x) =>
        !x.used && (typeof x.match === "string" ? r.latest.includes(x.match) : x.match.test(r.latest))
      )
      : undefined;
    if (rule && !rule.always) rule.used = true;
    const schema = body.output_config?.format?.schema; // a session title asks for JSON of this shape
    let reply: ModelReply = rule?.reply ?? { text: schema ? JSON.stringify({ title: "fake" }) : "ok" };
    while (typeof reply === "function") reply = reply(r);
    r.toolUse = "tool" in reply;
    this.requests.push(r);
    for (const w of [...this.#waiters]) {
      if (w.pred(r)) (this.#waiters.splice(this.#waiters.indexOf(w), 1), w.resolve(r));
    }
    const ev = (type: string, data: object) => `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`;
    const usage = { input_tokens: 10, output_tokens: 5, cache_creation_input_tokens: 0, cache_read_input_tokens: 0 };
    let sse = ev("message_start", {
      message: {
        id: `msg_${this.requests.length}`,
        type: "message",
        role: "assistant",
        model: body.model,
        content: [],
        stop_reason: null,
        stop_sequence: null,
        usage,
      },
    });
    if ("tool" in reply) {
      const json = JSON.stringify(reply.input);
      sse += ev("content_block_start", {
        index: 0,
        content_block: { type: "tool_use", id: `toolu_${this.requests.length}`, name: reply.tool, input: {} },
      });
      sse += ev("content_block_delta", { index: 0, delta: { type: "input_json_delta", partial_json: json } });
    } else {
      sse += ev("content_block_start", { index: 0, content_block: { type: "text", text: "" } });
      sse += ev("content_block_delta", { index: 0, delta: { type: "text_delta", text: reply.text } });
    }
    sse += ev("content_block_stop", { index: 0 });
    sse += ev("message_delta", {
      delta: { stop_reason: "tool" in reply ? "tool_use" : "end_turn", stop_sequence: null },
      usage: { output_tokens: 5 },
    });
    sse += ev("message_stop", {});
    return new Response(sse, { headers: { "content-type": "text/event-stream" } });
  }
}

// -- a scripted model for real Codex sessions ---------------------------------------------------------------

export interface CodexRequest {
  home: string;
  thread: string;
  // deno-lint-ignore no-explicit-any -- the request body as sent
  body: any;
  /** The text of the newest input item (a user turn, a queued one, or a tool's output). */
  latest: string;
  /** Every user message's text, in order: what was put in front of the model. */
  users: string[];
}

/** A reply: text, a call of one of interlink's tools (or, `builtin`, of Codex's own, such as exec_command). */
export type CodexReply =
  | { text: string }
  | { tool: string; args: unknown; builtin?: true }
  | ((r: CodexRequest) => CodexReply);

/** A scripted OpenAI Responses API for Codex: per home, rules tried in order against the newest input item. */
export class FakeResponses {
  readonly requests: CodexRequest[] = [];
  readonly url: string;
  #rules = new Map<string, { match: string | RegExp; reply: CodexReply; used: boolean; always: boolean }[]>();
  #waiters: { pred: (r: CodexRequest) => boolean; resolve(r: CodexRequest): void }[] = [];
  #server: ReturnType<typeof Bun.serve>;

  constructor() {
    this.#server = Bun.serve({ hostname: "127.0.0.1", port: 0, idleTimeout: 0, fetch: (req) => this.#handle(req) });
    this.url = `http://127.0.0.1:${this.#server.port}`;
  }

  baseUrl = (home: string) => `${this.url}/h/${home}/v1`;

  /** A rule answers once, or (`always`) every request it matches. */
  on(home: string, match: string | RegExp, reply: CodexReply, always = false): this {
    this.#rules.set(home, [...this.#rules.get(home) ?? [], { match, reply, used: false, always }]);
    return this;
  }

  of = (home: string) => this.requests.filter((r) => r.home === home);

  waitFor(pred: (r: CodexRequest) => boolean, what: string, ms = 30_000): Promise<CodexRequest> {
    const hit = this.requests.find(pred);
    if (hit) return Promise.resolve(hit);
    return new Promise((resolve, reject) => {
      const seen = () =>
        this.requests.map((r) => `  [${r.home}] ${r.latest.replace(/\s+/g, " ").slice(-200)}`).join("\n");
      const timer = setTimeout(
        () => reject(new Error(`the fake saw no request where ${what} within ${ms} ms:\n${seen()}`)),
        ms,
      );
      this.#waiters.push({ pred, resolve: (r) => (clearTimeout(timer), resolve(r)) });
    });
  }

  stop = () => this.#server.stop(true);

  async #handle(req: Request): Promise<Response> {
    const m = new URL(req.url).pathname.match(/^\/h\/([^/]+)\/v1\/responses$/);
    if (!m) return Response.json({ error: { message: "fake: no such route" } }, { status: 404 });
    const body = await req.json();
    // deno-lint-ignore no-explicit-any -- input items
    const text = (it: any): string =>
      typeof it?.output === "string"
        ? it.output
        : Array.isArray(it?.output ?? it?.content)
        ? (it.output ?? it.content).map((c: { text?: string }) => c?.text ?? "").join("")
        : "";
    // deno-lint-ignore no-explicit-any -- input items
    const input: any[] = body.input ?? [];
    const r: CodexRequest = {
      home: m[1],
      thread: req.headers.get("thread-id") ?? "",
      body,
      latest: text(input.at(-1)),
      users: input.filter((i) => (i.type ?? "message") === "message" && i.role === "user").map(text),
    };
    // A title request (a thread of its own, no tools, a JSON schema for {title}) is not a session's turn.
    const title = body.text?.format?.schema?.properties?.title !== undefined;
    const rule = title
      ? undefined
      : this.#rules.get(r.home)?.find((x) =>
        !x.used && (typeof x.match === "string" ? r.latest.includes(x.match) : x.match.test(r.latest))
      );
    if (rule && !rule.always) rule.used = true;
    let reply: CodexReply = rule?.reply ?? { text: title ? JSON.stringify({ title: "fake" }) : "ok" };
    while (typeof reply === "function") reply = reply(r);
    if (!title) {
      this.requests.push(r);
      for (const w of [...this.#waiters]) {
        if (w.pred(r)) (this.#waiters.splice(this.#waiters.indexOf(w), 1), w.resolve(r));
      }
    }
    const ev = (type: string, data: object) => `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`;
    const base = { id: `resp_${this.requests.length}`, object: "response", created_at: 1, model: body.model };
    const item = "tool" in reply
      ? {
        id: `fc_${this.requests.length}`,
        type: "function_call",
        status: "completed",
        call_id: `call_${this.requests.length}`,
        name: reply.tool,
        namespace: reply.builtin ? undefined : "mcp__interlink", // undefined: left out of the JSON
        arguments: JSON.stringify(reply.args),
      }
      : {
        id: `msg_${this.requests.length}`,
        type: "message",
        role: "assistant",
        status: "completed",
        content: [{ type: "output_text", text: reply.text, annotations: [] }],
      };
    const usage = {
      input_tokens: 10,
      input_tokens_details: { cached_tokens: 0 },
      output_tokens: 5,
      output_tokens_details: { reasoning_tokens: 0 },
      total_tokens: 15,
    };
    // The events the API streams, in its order (Codex reads a function call's arguments from their deltas).
    let n = 0;
    const at = () => ({ sequence_number: n++, output_index: 0 });
    let sse = ev("response.created", {
      sequence_number: n++,
      response: { ...base, status: "in_progress", output: [] },
    });
    if (item.type === "function_call") {
      sse += ev("response.output_item.added", { ...at(), item: { ...item, status: "in_progress", arguments: "" } });
      sse += ev("response.function_call_arguments.delta", { ...at(), item_id: item.id, delta: item.arguments });
      sse += ev("response.function_call_arguments.done", { ...at(), item_id: item.id, arguments: item.arguments });
    } else {
      const part = (item as { content: object[] }).content[0];
      sse += ev("response.output_item.added", { ...at(), item: { ...item, status: "in_progress", content: [] } });
      sse += ev("response.content_part.added", {
        ...at(),
        item_id: item.id,
        content_index: 0,
        part: { ...part, text: "" },
      });
      sse += ev("response.output_text.delta", {
        ...at(),
        item_id: item.id,
        content_index: 0,
        delta: (part as { text: string }).text,
      });
      sse += ev("response.content_part.done", { ...at(), item_id: item.id, content_index: 0, part });
    }
    sse += ev("response.output_item.done", { ...at(), item });
    sse += ev("response.completed", {
      sequence_number: n++,
      response: { ...base, status: "completed", output: [item], usage },
    });
    return new Response(sse, { headers: { "content-type": "text/event-stream" } });
  }
}
