/**
 * extras/codex.ts: `interlink.ts codex-install`, which installs interlink into
 * Codex CLI: its MCP server block in config.toml (between markers, the rest
 * byte for byte), the SessionStart hook that tells the server its thread, and
 * that hook's trust entry. Not part of a session: a Codex session needs only
 * interlink.ts (its waker, CodexWaker, is in the core).
 */

import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import {
  type CommandSpec,
  explicitSettings,
  EXTRAS,
  InterlinkError,
  isObject,
  OPT,
  type Options,
  type OptionSources,
  print,
  runExtra,
  selfCommand,
  trustTools,
  utf8,
  VERSION,
  WakeLatch,
  writeFileAtomic,
} from "../interlink.ts";

/** The SessionStart handler that binds a Codex thread to its interlink session. */
export const CODEX_BIND_HOOK = {
  type: "mcp_tool",
  server: "interlink",
  tool: "bind_session",
  input: { session: "${session_id}" },
} as const;

const CODEX_BEGIN = "# >>> interlink (written by `interlink.ts codex-install`; `codex-install --remove` takes it out)";

const CODEX_END = "# <<< interlink";

/**
 * Codex 0.171's trust hash of one hook handler: "sha256:" + hex of the SHA-256
 * of {event_name, hooks: [handler], matcher?} as JSON with sorted keys and no
 * spaces, the handler with its defaults (timeout 600; input {} for mcp_tool;
 * async false for command), numbers inside `input` written as serde_json's
 * {"$serde_json::private::Number": "<n>"}.
 */
export async function codexHookHash(
  event: string,
  handler: Record<string, unknown>,
  matcher?: string,
): Promise<string> {
  const canon = (v: unknown, input: boolean): string => {
    if (typeof v === "number" && input) return `{"$serde_json::private::Number":${JSON.stringify(String(v))}}`;
    if (Array.isArray(v)) return `[${v.map((x) => canon(x, input)).join(",")}]`;
    if (isObject(v)) {
      return `{${
        Object.keys(v).filter((k) => v[k] !== undefined).sort().map((k) =>
          `${JSON.stringify(k)}:${canon(v[k], input || k === "input")}`
        ).join(",")
      }}`;
    }
    return JSON.stringify(v);
  };
  const h: Record<string, unknown> = { timeout: 600, ...handler };
  if (h.type === "command") h.async ??= false;
  if (h.type === "mcp_tool") h.input ??= {};
  const whole = { event_name: event, hooks: [h], ...(matcher === undefined ? {} : { matcher }) };
  const digest = await crypto.subtle.digest("SHA-256", utf8.encode(canon(whole, false)));
  return `sha256:${Buffer.from(digest).toString("hex")}`;
}

/** A TOML basic string. */
const tomlString = (s: string) => JSON.stringify(s).replace(/\u007f/g, "\\u007F");

/** Our block for config.toml: the server, its environment, trust-changing tools kept asking, the hook's trust. */
export function codexConfigBlock(p: {
  command: string[];
  env: Record<string, string>;
  trust: { key: string; hash: string };
}): string {
  const [cmd, ...args] = p.command;
  return [
    CODEX_BEGIN,
    "[mcp_servers.interlink]",
    `command = ${tomlString(cmd)}`,
    `args = [${args.map(tomlString).join(", ")}]`,
    "startup_timeout_sec = 60",
    "# Its tools run without a prompt; the ones that change trust keep asking (they are operator decisions).",
    'default_tools_approval_mode = "approve"',
    ...trustTools().flatMap((tool) => [
      `[mcp_servers.interlink.tools.${tool}]`,
      'approval_mode = "prompt"',
    ]),
    "[mcp_servers.interlink.env]",
    ...Object.entries(p.env).map(([k, v]) => `${k} = ${tomlString(v)}`),
    `[hooks.state.${tomlString(p.trust.key)}]`,
    `trusted_hash = ${tomlString(p.trust.hash)}`,
    CODEX_END,
  ].join("\n");
}

/**
 * config.toml with our block in place of an earlier one of ours (or at the
 * end), or without it (`block` null). A table [mcp_servers.interlink] the user
 * wrote themselves is never touched: that is an error saying what to do.
 */
export function withCodexBlock(toml: string, block: string | null): string {
  const begin = toml.indexOf(CODEX_BEGIN);
  const end = begin < 0 ? -1 : toml.indexOf(CODEX_END, begin);
  if (begin >= 0 && end < 0) {
    throw new InterlinkError(`config.toml has our start marker but not our end marker (${CODEX_END}); fix it by hand`);
  }
  const outside = begin < 0 ? toml : toml.slice(0, begin) + toml.slice(end + CODEX_END.length);
  if (
    /^\s*\[\s*mcp_servers\s*\.\s*("interlink"|interlink)\s*[\].]/m.test(outside) ||
    /^\s*interlink\s*=\s*\{/m.test(outside)
  ) {
    throw new InterlinkError(
      "config.toml already configures an MCP server named interlink that codex-install did not write; remove or rename it, then run codex-install again",
    );
  }
  if (begin >= 0) {
    const after = toml.slice(end + CODEX_END.length).replace(/^\n/, "");
    if (block !== null) return toml.slice(0, begin) + block + "\n" + after;
    // The blank line put before our block when it was added goes with it.
    const before = toml.slice(0, begin);
    return (after === "" && /[^\n]\n\n$/.test(before) ? before.slice(0, -1) : before) + after;
  }
  if (block === null) return toml;
  return (toml === "" || toml.endsWith("\n\n") ? toml : toml.endsWith("\n") ? toml + "\n" : toml + "\n\n") + block +
    "\n";
}

/** hooks.json with our SessionStart group (added once; everything else kept in order), and where our handler is. */
export function withCodexHook(text: string | null, remove = false): { text: string; group: number; handler: number } {
  let raw: unknown = { hooks: {} };
  if (text !== null && text.trim() !== "") {
    try {
      raw = JSON.parse(text);
    } catch (e) {
      throw new InterlinkError(
        `hooks.json is not JSON (${(e as Error).message}); fix it, then run codex-install again`,
      );
    }
  }
  if (!isObject(raw) || (raw.hooks !== undefined && !isObject(raw.hooks))) {
    throw new InterlinkError(`hooks.json must be an object {"hooks": {...}} (Codex's layout)`);
  }
  const hooks = (raw.hooks ?? {}) as Record<string, unknown>;
  const groups = Array.isArray(hooks.SessionStart) ? [...hooks.SessionStart] : [];
  const ours = (h: unknown) =>
    isObject(h) && h.type === "mcp_tool" && h.server === "interlink" && h.tool === "bind_session";
  const found = groups.findIndex((g) => isObject(g) && Array.isArray(g.hooks) && g.hooks.some(ours));
  if (remove) {
    const kept = groups.filter((_, i) => i !== found);
    const next = { ...raw, hooks: { ...hooks, SessionStart: kept } };
    if (!kept.length) delete (next.hooks as Record<string, unknown>).SessionStart;
    return { text: JSON.stringify(next, null, 2) + "\n", group: -1, handler: -1 };
  }
  if (found >= 0) {
    const handler = (groups[found] as { hooks: unknown[] }).hooks.findIndex(ours);
    return { text: text ?? "", group: found, handler };
  }
  groups.push({ hooks: [CODEX_BIND_HOOK] });
  return {
    text: JSON.stringify({ ...raw, hooks: { ...hooks, SessionStart: groups } }, null, 2) + "\n",
    group: groups.length - 1,
    handler: 0,
  };
}

/** The codex binary: --codex-bin / INTERLINK_CODEX_BIN, else `codex` on PATH. */
function findCodex(given: string | undefined): string | null {
  if (given) return given;
  for (const dir of (process.env.PATH ?? "").split(path.delimiter)) {
    const f = path.join(dir, "codex");
    if (dir && fs.existsSync(f)) return f;
  }
  return null;
}

/** What `codex app-server` (hooks/list) says of the hook under `key`: its trust status and hash, or why it cannot tell. */
async function codexHookStatus(
  bin: string,
  home: string,
  key: string,
): Promise<{ trust: string; hash?: string } | { error: string }> {
  const child = spawn(bin, ["app-server"], {
    stdio: ["pipe", "pipe", "pipe"],
    env: { ...process.env, CODEX_HOME: home },
  });
  const answers = new Map<number, unknown>();
  let buf = "";
  const arrived = new WakeLatch();
  child.stdout!.on("data", (d: Buffer) => {
    buf += d;
    for (let nl = buf.indexOf("\n"); nl >= 0; nl = buf.indexOf("\n")) {
      try {
        const m = JSON.parse(buf.slice(0, nl));
        if (isObject(m) && typeof m.id === "number") answers.set(m.id, m.result ?? m.error);
      } catch {
        // not ours
      }
      buf = buf.slice(nl + 1);
      arrived.wake();
    }
  });
  child.on("error", () => arrived.wake());
  const call = async (id: number, method: string, params: object) => {
    child.stdin!.write(JSON.stringify({ jsonrpc: "2.0", id, method, params }) + "\n");
    const deadline = Date.now() + 10_000;
    while (!answers.has(id) && Date.now() < deadline && child.exitCode === null) await arrived.wait(500);
    return answers.get(id);
  };
  try {
    await call(1, "initialize", { clientInfo: { name: "interlink-codex-install", version: VERSION } });
    child.stdin!.write(JSON.stringify({ jsonrpc: "2.0", method: "initialized" }) + "\n");
    const listed = await call(2, "hooks/list", { cwds: [process.cwd()] });
    const all = JSON.stringify(listed ?? null);
    const hooks: unknown[] = [];
    const walk = (v: unknown) => {
      if (Array.isArray(v)) v.forEach(walk);
      else if (isObject(v)) {
        typeof v.key === "string" && "trustStatus" in v ? hooks.push(v) : Object.values(v).forEach(walk);
      }
    };
    walk(listed);
    const ours = hooks.find((h) => isObject(h) && h.key === key) as Record<string, unknown> | undefined;
    if (!ours) return { error: `codex app-server does not list the hook (${all.slice(0, 200)})` };
    return {
      trust: String(ours.trustStatus),
      ...(typeof ours.currentHash === "string" ? { hash: ours.currentHash } : {}),
    };
  } finally {
    child.kill();
  }
}

/** `codex-install`: interlink as an MCP server of Codex CLI, with the hook that binds a thread, trusted. */
async function runCodexInstall(o: Options, _pos: string[], from: OptionSources): Promise<number> {
  const home = path.resolve((o["codex-home"] as string | undefined) ?? path.join(os.homedir(), ".codex"));
  fs.mkdirSync(home, { recursive: true, mode: 0o700 });
  const configPath = path.join(home, "config.toml");
  const hooksPath = path.join(home, "hooks.json");
  const read = (f: string) => (fs.existsSync(f) ? fs.readFileSync(f, "utf8") : null);
  const oldConfig = read(configPath) ?? "";
  const oldHooks = read(hooksPath);
  const bin = findCodex(o["codex-bin"] as string | undefined);
  if (o.remove === true) {
    const hooks = withCodexHook(oldHooks, true);
    writeFileAtomic(configPath, withCodexBlock(oldConfig, null));
    if (oldHooks !== null) writeFileAtomic(hooksPath, hooks.text);
    print(`removed interlink from ${configPath} and its hook from ${hooksPath}; everything else is as it was`);
    return 0;
  }
  const hooks = withCodexHook(oldHooks);
  // The trust key names the file by its real path (a symlinked CODEX_HOME is keyed where it leads).
  if (hooks.text !== oldHooks) writeFileAtomic(hooksPath, hooks.text);
  const key = `${fs.realpathSync(hooksPath)}:session_start:${hooks.group}:${hooks.handler}`;
  const env: Record<string, string> = {
    INTERLINK_HOST: "codex",
    CODEX_HOME: home,
    ...(bin ? { INTERLINK_CODEX_BIN: path.resolve(bin) } : {}),
  };
  for (const [k, v] of Object.entries(explicitSettings(o, from))) env[`INTERLINK_${k.toUpperCase()}`] = v;
  // Codex passes its servers only the variables it is told of: the config.json this very command used, too.
  if (process.env.INTERLINK_CONFIG) env.INTERLINK_CONFIG = process.env.INTERLINK_CONFIG;
  const block = (hash: string) => codexConfigBlock({ command: selfCommand(["mcp"]), env, trust: { key, hash: hash } });
  let hash = await codexHookHash("session_start", { ...CODEX_BIND_HOOK });
  writeFileAtomic(configPath, withCodexBlock(oldConfig, block(hash)));
  print(`${configPath}: ${oldConfig.includes(CODEX_BEGIN) ? "replaced" : "added"} this block (nothing else changed):`);
  print(block(hash).split("\n").map((l) => `  + ${l}`).join("\n"));
  print(
    hooks.text === oldHooks
      ? `${hooksPath}: its SessionStart hook for interlink was already there (group ${hooks.group})`
      : `${hooksPath}: added a SessionStart group (${hooks.group}) running interlink's bind_session with the thread id`,
  );
  if (!bin) {
    print(
      "codex is not on PATH, so the hook's trust could not be checked; if Codex says \"Hooks need review\", open /hooks and trust interlink's",
    );
    return 0;
  }
  let status = await codexHookStatus(bin, home, key);
  if ("trust" in status && status.trust !== "trusted" && status.hash && status.hash !== hash) {
    // A Codex that hashes differently: take the hash it reports for this very handler, and check again.
    hash = status.hash;
    writeFileAtomic(configPath, withCodexBlock(oldConfig, block(hash)));
    status = await codexHookStatus(bin, home, key);
  }
  print(
    "trust" in status && status.trust === "trusted"
      ? `checked with ${bin} app-server: the hook is trusted; start codex as usual`
      : `could not confirm the hook's trust (${
        "trust" in status ? status.trust : status.error
      }): if Codex says "Hooks need review", open /hooks and trust interlink's`,
  );
  print(
    "Not supported: `codex exec` one-shot runs and ephemeral threads (they cannot be woken), and subagents (interlink serves the root session). Sessions run with --no-daemon or -c are woken within ~10 s.",
  );
  return 0;
}

export const command: CommandSpec = {
  summary: EXTRAS["codex-install"].summary,
  about: "Writes a [mcp_servers.interlink] block between markers in $CODEX_HOME/config.toml (nothing else changes),\n" +
    "a SessionStart hook in hooks.json that tells the server its thread, and that hook's trust entry; then, if\n" +
    "codex is found, checks with `codex app-server` that the hook reads as trusted. The node settings given here\n" +
    "(--url, --name, --key, --peers, --state, or their INTERLINK_* variables) go into the server's environment.",
  options: {
    key: OPT.key,
    peers: OPT.peers,
    url: OPT.url,
    state: OPT.state,
    name: OPT.name,
    "codex-home": {
      type: "string",
      arg: "DIR",
      env: "CODEX_HOME",
      defaultHelp: "~/.codex",
      help: "Codex's home folder (config.toml, hooks.json)",
    },
    "codex-bin": {
      type: "string",
      arg: "PATH",
      env: "INTERLINK_CODEX_BIN",
      defaultHelp: "codex on PATH",
      help: "the codex binary (the server runs `codex queue` with it to wake the session)",
    },
    remove: { type: "boolean", help: "take interlink's block and hook out again" },
  },
  run: runCodexInstall,
};

if (import.meta.main) runExtra("codex-install", command);
