// Tests for extras/doctor.ts, `interlink.ts doctor`: what it finds in a node's files and on its relays, and the fix it
// names for each problem. Scenarios that use doctor as one tool among others stay with the core (interlink.test.ts);
// its NATS checks are in nats.test.ts; the helpers the files share are in dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import * as fs from "node:fs";
import * as path from "node:path";
import { writeKeyFile } from "../interlink.ts";
import {
  freePort,
  makeNodeFiles,
  runCli,
  runCliAsync,
  SCRIPT,
  spawnAsync,
  startBus,
  stop,
  sweepAfterAll,
  tmpDir,
} from "../dev/testkit.ts";

sweepAfterAll();

describe("doctor: a node's set-up, each problem with its fix", () => {
  test("doctor reports a dead bus, a bad peers.json and a readable key as problems, with fixes", async () => {
    const root = tmpDir();
    const keyFile = path.join(root, "id.key");
    writeKeyFile(keyFile, crypto.getRandomValues(new Uint8Array(32)), false);
    const peersFile = path.join(root, "peers.json");
    fs.writeFileSync(peersFile, JSON.stringify({ bob: { key: "not-a-key" } }));
    fs.chmodSync(keyFile, 0o644);
    fs.mkdirSync(path.join(root, "state", "sessions", "main"), { recursive: true });
    fs.writeFileSync(
      path.join(root, "state", "sessions", "main", "log.jsonl.corrupt"),
      '{"offset":0}\n{"offset":90}\n',
    );
    // This machine's bus set aside a damaged payload of its queue.db (see bus.ts).
    const busData = path.join(root, "xdg", "interlink", "bus");
    fs.mkdirSync(busData, { recursive: true });
    fs.writeFileSync(path.join(busData, "queue.db.corrupt"), '{"offset":7,"reason":"not JSON"}\n');
    const port = await freePort();
    const r = runCli("bun", ["doctor"], {
      env: {
        INTERLINK_KEY: keyFile,
        INTERLINK_PEERS: peersFile,
        INTERLINK_URL: `http://127.0.0.1:${port}`,
        INTERLINK_STATE: path.join(root, "state"),
        XDG_STATE_HOME: path.join(root, "xdg"),
      },
    });
    expect(r.code).toBe(1);
    expect(r.stdout).toMatch(/PROBLEM {2}key file .* is readable by others \(mode 644\)\n\s+fix: chmod 600/);
    expect(r.stdout).toMatch(/PROBLEM {2}Cannot parse .*peers\.json: 'bob'/);
    expect(r.stdout).toMatch(new RegExp(`PROBLEM  bus http://127.0.0.1:${port} is unreachable`));
    expect(r.stdout).toContain("ok       runtime bun");
    expect(r.stdout).toMatch(/PROBLEM {2}2 unreadable line\(s\) were taken out of .*log\.jsonl/);
    expect(r.stdout).toMatch(/PROBLEM {2}1 damaged payload\(s\) were set aside from .*queue\.db, this machine's bus's/);
    fs.rmSync(path.join(root, "state", "sessions", "main", "log.jsonl.corrupt"));
    // And a healthy set-up passes, under Deno this time.
    fs.chmodSync(keyFile, 0o600);
    fs.writeFileSync(peersFile, "{}");
    const bus = await startBus("bun", path.join(root, "bus"));
    try {
      const good = runCli("deno", ["doctor"], {
        env: {
          INTERLINK_KEY: keyFile,
          INTERLINK_PEERS: peersFile,
          INTERLINK_URL: bus.url,
          INTERLINK_STATE: path.join(root, "state"),
        },
      });
      expect({ code: good.code, out: good.stdout }).toEqual({
        code: 0,
        out: expect.stringContaining("no problems found"),
      });
      expect(good.stdout).toMatch(/ok {7}clock within \d+ s of/);
      expect(good.stdout).toMatch(/ok {7}bus .*: its file-descriptor limit allows about \d+ sessions at once/);
    } finally {
      await stop(bus);
    }
  }, 60_000);

  test("a slow server start is said on stderr, which Claude Code logs, and by doctor; a quick one is ok", async () => {
    const root = tmpDir();
    const env = {
      ...process.env,
      INTERLINK_KEY: path.join(root, "id.key"),
      INTERLINK_PEERS: path.join(root, "peers.json"),
      INTERLINK_STATE: path.join(root, "state"),
      INTERLINK_CONFIG: path.join(root, "config.json"),
      INTERLINK_URL: "http://127.0.0.1:9",
    };
    const initialize = JSON.stringify({
      jsonrpc: "2.0",
      id: 1,
      method: "initialize",
      params: { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "test", version: "1" } },
    });
    const start = (more: Record<string, string>) =>
      spawnAsync(process.execPath, [SCRIPT, "mcp"], { env: { ...env, ...more }, input: initialize + "\n", cwd: root });
    writeKeyFile(env.INTERLINK_KEY, crypto.getRandomValues(new Uint8Array(32)), false);
    const doctor = (more: Record<string, string> = {}) => runCli("bun", ["doctor"], { env: { ...env, ...more } });
    expect(doctor().stdout).not.toContain("the last server start"); // none yet
    const quick = await start({});
    expect({ code: quick.status, warned: quick.stderr.includes("before the server could answer") })
      .toEqual({ code: 0, warned: false });
    expect(doctor().stdout).toMatch(/ok {7}the last server start \(bun [^)]*\) answered after \d+\.\d s/);
    // Any start counts as slow past 1 ms.
    const slow = await start({ INTERLINK_TEST_SLOW_START_MS: "1" });
    expect(slow.status).toBe(0);
    expect(slow.stderr).toMatch(/this start took \d+\.\d s before the server could answer; .*MCP_TIMEOUT/);
    const said = doctor({ INTERLINK_TEST_SLOW_START_MS: "1" }).stdout;
    expect(said).toMatch(/PROBLEM {2}the last server start .* answered after [\d.]+ s;.*\n\s+fix: .*MCP_TIMEOUT=60000/);
  }, 60_000);
});

describe("doctor against a hostile relay", () => {
  test(
    "doctor counts a roster's JSON values before parsing it: 24 MiB of empty objects is a problem named, not 700 MB",
    async () => {
      const roster = `{"roster":[${"{},".repeat(8_000_000).slice(0, -1)}]}`;
      const relay = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: () => new Response(roster) });
      try {
        const root = tmpDir();
        const A = await makeNodeFiles(root, "alice");
        const r = await runCliAsync("bun", ["doctor"], {
          env: {
            INTERLINK_KEY: A.keyFile,
            INTERLINK_PEERS: A.peersFile,
            INTERLINK_STATE: A.stateDir,
            INTERLINK_URL: `http://127.0.0.1:${relay.port}`,
          },
        });
        expect(r.stdout).toMatch(
          /PROBLEM {2}bus http:\/\/127\.0\.0\.1:\d+ is unreachable: .*more than \d+ JSON values/,
        );
      } finally {
        relay.stop(true);
      }
    },
    60_000,
  );
});
