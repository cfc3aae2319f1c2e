// Tests for extras/upgrade.ts, `interlink.ts upgrade`: a state folder interlink.ts 0.4.0 wrote is refused by every
// session, which says what to run, until the upgrade carries it over; then nothing it held is lost. That each fixture
// journal of 0.4.0 and 0.5.0 folds as it did once upgraded is in interlink.test.ts ("the journal: …"); the helpers the
// files share are in dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import * as fs from "node:fs";
import * as path from "node:path";
import { Agent, journalFiles, readIdentity } from "../interlink.ts";
import { upgradeStateFolder } from "./upgrade.ts";
import {
  eventually,
  logged,
  McpNode,
  nodeConfig,
  type NodeFiles,
  REPO,
  runCli,
  startBus,
  stop,
  sweepAfterAll,
  tmpDir,
} from "../dev/testkit.ts";

sweepAfterAll();

const FIXTURES = path.join(REPO, "fixtures", "journals");

/** A copy of a fixture node's folder (key, peers.json, state/), as that release left it. */
async function fixtureNode(release: string, node: string): Promise<NodeFiles> {
  const dir = tmpDir();
  fs.cpSync(path.join(FIXTURES, release, node), dir, { recursive: true });
  const keyFile = path.join(dir, "id.key");
  const id = await readIdentity(keyFile);
  return { name: node, dir, keyFile, peersFile: path.join(dir, "peers.json"), stateDir: path.join(dir, "state"), id };
}

/** Every file under `dir` with its bytes (what a refusal must leave as it was), but for a session's own start record. */
function snapshot(dir: string): Record<string, string> {
  const files = fs.readdirSync(dir, { recursive: true, withFileTypes: true }).filter((e) => e.isFile());
  return Object.fromEntries(
    files.map((e) => path.join(e.parentPath, e.name)).filter((f) => path.basename(f) !== "last-start.json").sort()
      .map((f) => [path.relative(dir, f), fs.readFileSync(f, "base64")]),
  );
}

describe("upgrade: a state folder of interlink.ts 0.4.0, carried over once", () => {
  test.concurrent(
    "no session opens on it and each says what to run, changing nothing; `upgrade` carries it over once (Bun, then nothing more under Deno); the next session shows what was unread and sends what was queued",
    async () => {
      const B = await fixtureNode("journal-0.4.0-94f0894", "bob"); // its journal, an inbox.cursor, one message queued
      const env = {
        INTERLINK_KEY: B.keyFile,
        INTERLINK_PEERS: B.peersFile,
        INTERLINK_STATE: B.stateDir,
        INTERLINK_CONFIG: path.join(B.dir, "config.json"),
        INTERLINK_URL: "http://127.0.0.1:9",
      };
      const said =
        `${path.join(B.stateDir, "log.jsonl")} was written by interlink.ts 0.4.0: this release reads it only ` +
        `once it is upgraded. Run \`interlink.ts upgrade --state ${B.stateDir}\``;
      const before = snapshot(B.stateDir);
      const send = runCli("bun", ["send", "alice", "hi"], { env });
      expect({ code: send.code, said: send.stderr.includes(said) }).toEqual({ code: 1, said: true });
      // A session's tools answer with it (the server runs on, as for any problem it can outlive).
      const inert = { INTERLINK_DELIVERY: "inbox", INTERLINK_AUTOSTART_BUS: "0", INTERLINK_SESSION: "b1" };
      const refused = await McpNode.start("deno", B, "http://127.0.0.1:9", inert);
      try {
        const r = await refused.call("check_inbox", {});
        expect({ isError: r.isError, said: r.text.includes(said) }).toEqual({ isError: true, said: true });
        expect((await refused.call("list_pending", {})).text).toContain(said);
      } finally {
        await refused.close();
      }
      expect(snapshot(B.stateDir)).toEqual(before); // nothing moved, rewritten or added
      const moved = path.join(B.stateDir, "sessions", "0.4.0-journal");
      const up = runCli("bun", ["upgrade"], { env });
      expect({ code: up.code, stderr: up.stderr }).toEqual({ code: 0, stderr: "" });
      expect(up.stdout.trim().split("\n")).toEqual([
        `moved log.jsonl, inbox.cursor of interlink.ts 0.4.0 from ${B.stateDir} into session 0.4.0-journal (${moved})`,
        `${path.join(moved, "inbox.cursor")}: 6 message(s) before it marked read`,
        `${path.join(moved, "log.jsonl")}: 2 record(s) of interlink.ts 0.4.0 rewritten`,
        `upgraded ${B.stateDir}: its sessions open again, and carry on what it held`,
      ]);
      const again = runCli("deno", ["upgrade"], { env });
      expect({ code: again.code, out: again.stdout }).toEqual({
        code: 0,
        out: `nothing of interlink.ts 0.4.0 in ${B.stateDir}: nothing to upgrade\n`,
      });
      // The next session adopts the moved journal like any session that ended: what came after the cursor is shown,
      // what came before it is not; the message 0.4.0 had queued is sent (re-signed: it is days old).
      const bus = await startBus("bun", path.join(B.dir, "bus"));
      const b1 = await McpNode.start("bun", B, bus.url, { ...inert, INTERLINK_URL: bus.url });
      try {
        const inbox = await b1.ok("check_inbox", { limit: 50 });
        for (const text of ["unread two", "written a day ago, offline"]) expect(inbox).toContain(text);
        for (const text of ["unread one", "hello bob", "run the linter"]) expect(inbox).not.toContain(text);
        await eventually(async () => (await b1.ok("list_pending")).includes("the outbox is empty"), "queued: sent");
        const alice = JSON.parse(fs.readFileSync(B.peersFile, "utf8")).alice.key;
        const got = await (await fetch(`${bus.url}/recv?me=${encodeURIComponent(alice)}&timeout_ms=5000`)).json();
        expect(got.envelope.payload.text).toBe("bob's reply, queued too");
      } finally {
        await b1.close();
        await stop(bus);
      }
    },
    120_000,
  );

  test("a journal a 0.5.0 node moved into a session keeps 0.4.0's records: that session refuses, naming its file, and a sibling leaves it alone; upgraded, it opens, and upgrading again changes nothing", async () => {
    const B = await fixtureNode("journal-0.4.0-a98dd80", "bob");
    const old = path.join(B.stateDir, "sessions", "old");
    fs.mkdirSync(old, { recursive: true });
    fs.renameSync(path.join(B.stateDir, "log.jsonl"), path.join(old, "log.jsonl"));
    const cfg = (session: string) => ({ ...nodeConfig(B, ["http://127.0.0.1:9"], "inbox"), session });
    const before = snapshot(old);
    await expect(Agent.open(cfg("old"), "test")).rejects.toThrow(
      `${path.join(old, "log.jsonl")} holds records of interlink.ts 0.4.0: this release reads it only once it is ` +
        `upgraded. Run \`interlink.ts upgrade --state ${B.stateDir}\``,
    );
    // Another session opens; its look at ended sessions leaves this one as it is, and says why.
    const sibling = await Agent.open(cfg("new"), "test");
    await sibling.stop();
    expect(logged.some((l) => l.includes("cannot adopt ended session old: ") && l.includes("interlink.ts upgrade")))
      .toBe(true);
    expect(snapshot(old)).toEqual(before);
    expect(await upgradeStateFolder(B.stateDir)).toEqual([
      `${path.join(old, "log.jsonl")}: 8 record(s) of interlink.ts 0.4.0 rewritten`,
    ]);
    const upgraded = snapshot(old);
    expect(await upgradeStateFolder(B.stateDir)).toEqual([]);
    expect(snapshot(old)).toEqual(upgraded);
    const agent = await Agent.open(cfg("old"), "test", { adopt: false });
    try {
      const expected = JSON.parse(
        fs.readFileSync(path.join(FIXTURES, "journal-0.4.0-a98dd80", "bob", "expected.json"), "utf8"),
      );
      expect([...agent.state.pending.keys()]).toEqual(expected.fold.pending); // the outbox it held, in order
      expect(journalFiles(old).map((f) => path.basename(f))).toEqual(["log.jsonl"]);
    } finally {
      await agent.stop();
    }
  });
});
