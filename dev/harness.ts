/**
 * dev/harness.ts: drives interlink nodes from outside, as Claude Code does: an
 * `interlink.ts mcp` child over stdio through the official MCP SDK client
 * (McpSession), and children of interlink.ts (a bus, a demo node). Shared by
 * the demo, the tests and the benchmark; no session loads it.
 */

import { spawn } from "node:child_process";
import * as path from "node:path";
// deno-lint-ignore no-import-prefix -- the pin lives in the specifier, as for every package interlink.ts loads
import type { Client as McpClient } from "npm:@modelcontextprotocol/sdk@1.32.2/client/index.js";
// deno-lint-ignore no-import-prefix -- as above
import type { StdioClientTransport as McpClientTransport } from "npm:@modelcontextprotocol/sdk@1.32.2/client/stdio.js";
import {
  type Identity,
  identityFromSeed,
  InterlinkError,
  type PushEvent,
  selfCommand,
  sleep,
  VERSION,
  writeKeyFile,
} from "../interlink.ts";
import { importPinned } from "../nats.ts";

/**
 * The npm packages interlink loads, pinned here and nowhere else (package.json
 * and bun.lock follow; a test checks). No session needs them: `mcp` speaks
 * MCP itself (see McpStdioServer), and `wait`, the bus and the CLI import
 * nothing from npm. The MCP SDK's client drives servers in `demo` (and the
 * tests and bench.ts); zod is the version it runs with.
 */
export const SDK = { name: "@modelcontextprotocol/sdk", version: "1.32.2" } as const;

export const ZOD = { name: "zod", version: "4.6.7" } as const;

/**
 * An `interlink.ts mcp` child driven over stdio by the official SDK client,
 * exactly as Claude Code drives it: used by `demo`, bench.ts and the tests.
 * Channel events are collected as they arrive.
 */
export class McpSession {
  readonly events: PushEvent[] = [];
  readonly stderr: string[] = [];
  #waiters: (() => void)[] = [];

  private constructor(readonly label: string, readonly client: McpClient, readonly transport: McpClientTransport) {}

  static async start(
    label: string,
    argv: string[],
    env: Record<string, string>,
    opts: { cwd?: string; onStderr?: (line: string) => void } = {},
  ): Promise<McpSession> {
    const { Client } = await importPinned<typeof import("npm:@modelcontextprotocol/sdk@1.32.2/client/index.js")>(
      SDK,
      "/client/index.js",
    );
    const { StdioClientTransport } = await importPinned<
      typeof import("npm:@modelcontextprotocol/sdk@1.32.2/client/stdio.js")
    >(SDK, "/client/stdio.js");
    const [command, ...args] = argv;
    const transport = new StdioClientTransport({
      command,
      args,
      env,
      stderr: "pipe",
      ...(opts.cwd ? { cwd: opts.cwd } : {}),
    });
    const client = new Client({ name: "interlink-driver", version: VERSION });
    const session = new McpSession(label, client, transport);
    client.fallbackNotificationHandler = (n: { method: string; params?: unknown }) => {
      if (n.method === "notifications/claude/channel") {
        session.events.push(n.params as unknown as PushEvent);
        for (const wake of session.#waiters.splice(0)) wake();
      }
      return Promise.resolve();
    };
    let partial = "";
    transport.stderr?.on("data", (chunk: Buffer) => {
      const lines = (partial + chunk.toString()).split("\n");
      partial = lines.pop()!;
      for (const line of lines) {
        session.stderr.push(line);
        opts.onStderr?.(line);
      }
    });
    await client.connect(transport);
    // Under Bun as the host, node:child_process reports the child's exit only
    // once something listens for its stdout 'end'; without this, close() sits
    // out its 2 s + 2 s grace timers although the server exited at once.
    (transport as unknown as { _process?: { stdout?: { on(event: string, f: () => void): void } } })._process?.stdout
      ?.on("end", () => {});
    return session;
  }

  async call(name: string, args: Record<string, unknown> = {}): Promise<{ text: string; isError: boolean }> {
    let r;
    try {
      r = await this.client.callTool({ name, arguments: args });
    } catch (e) {
      // A call that got no answer (a timeout, a server gone): what the server last logged says why.
      throw new InterlinkError(
        `${this.label}: ${name}: ${(e as Error).message}; its last log lines:\n${this.stderr.slice(-15).join("\n")}`,
      );
    }
    return { text: (r.content as { text: string }[]).map((c) => c.text).join("\n"), isError: r.isError === true };
  }

  /** Calls a tool that must succeed and returns its text. */
  async ok(name: string, args: Record<string, unknown> = {}): Promise<string> {
    const r = await this.call(name, args);
    if (r.isError) throw new InterlinkError(`${this.label}: ${name} failed: ${r.text}`);
    return r.text;
  }

  async waitEvent(match: (e: PushEvent) => boolean, ms = 20_000): Promise<PushEvent> {
    const deadline = Date.now() + ms;
    for (;;) {
      const hit = this.events.find(match);
      if (hit) return hit;
      if (Date.now() > deadline) {
        throw new InterlinkError(
          `${this.label}: no matching channel event within ${ms} ms; stderr:\n${this.stderr.join("\n")}`,
        );
      }
      await new Promise<void>((resolve) => {
        this.#waiters.push(resolve);
        setTimeout(resolve, 200);
      });
    }
  }

  async waitStderr(re: RegExp, ms = 20_000): Promise<string> {
    const deadline = Date.now() + ms;
    for (;;) {
      const hit = this.stderr.find((l) => re.test(l));
      if (hit) return hit;
      if (Date.now() > deadline) {
        throw new InterlinkError(`${this.label}: no stderr line matched ${re}:\n${this.stderr.join("\n")}`);
      }
      await sleep(50);
    }
  }

  get pid(): number | null {
    return this.transport.pid;
  }

  async close(): Promise<void> {
    await this.client.close();
  }
}

/** Environment for child processes we start: ours, minus any INTERLINK_* that would point them at the user's real node. */
export function childEnv(extra: Record<string, string>): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) if (v !== undefined && !k.startsWith("INTERLINK_")) env[k] = v;
  return { ...env, ...extra };
}

/** Starts `interlink.ts bus` as a child on a free loopback port and resolves once it listens. */
export function startChildBus(
  dataDir: string,
  port = 0,
): Promise<{ url: string; child: ReturnType<typeof spawn>; stderr: string[] }> {
  return startChild(["bus", "--port", String(port), "--data", dataDir]);
}

/**
 * Starts this file with `argv` as a child that says "listening on <url>" on stderr; resolves once it does. bench.ts
 * passes its own `command` (its floor, or a bus under the other runtime).
 */
export async function startChild(
  argv: string[],
  command: string[] = selfCommand(argv),
): Promise<{ url: string; child: ReturnType<typeof spawn>; stderr: string[] }> {
  const [cmd, ...args] = command;
  const child = spawn(cmd, args, { stdio: ["ignore", "ignore", "pipe"], env: childEnv({}) });
  const stderr: string[] = [];
  const url = await new Promise<string>((resolve, reject) => {
    let buf = "";
    child.stderr!.on("data", (d: Buffer) => {
      buf += d.toString();
      const lines = buf.split("\n");
      buf = lines.pop()!;
      stderr.push(...lines);
      const m = lines.join("\n").match(/listening on (http:\/\/\S+)/);
      if (m) resolve(m[1]);
    });
    child.once("exit", (code) => reject(new InterlinkError(`${argv[0]} exited with ${code}:\n${stderr.join("\n")}`)));
  });
  return { url, child, stderr };
}

export async function stopChild(child: ReturnType<typeof spawn>): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise((r) => child.once("exit", r));
  child.kill("SIGTERM");
  await Promise.race([exited, sleep(3000)]);
  if (child.exitCode === null) child.kill("SIGKILL");
}

/** A demo node: key and peers in a temp folder, an agent started by us and driven through the MCP SDK client. */
export async function startDemoNode(
  root: string,
  name: string,
  busUrl: string,
): Promise<{ session: McpSession; id: Identity }> {
  const dir = path.join(root, name);
  const seed = crypto.getRandomValues(new Uint8Array(32));
  writeKeyFile(path.join(dir, "id.key"), seed, false);
  const env = childEnv({
    INTERLINK_KEY: path.join(dir, "id.key"),
    INTERLINK_PEERS: path.join(dir, "peers.json"),
    INTERLINK_STATE: path.join(dir, "state"),
    INTERLINK_URL: busUrl,
    INTERLINK_NAME: name,
    // The demo plays a session launched by `interlink.ts claude`, so events arrive as they happen.
    INTERLINK_DELIVERY: "channel",
    INTERLINK_SESSION: name,
    INTERLINK_CONFIG: path.join(dir, "config.json"), // never this machine's own settings
  });
  return { session: await McpSession.start(name, selfCommand(["mcp"]), env), id: await identityFromSeed(seed) };
}
