// Tests for nats.ts, NATS JetStream as the relay: real nats-server processes on loopback ports, agents under Bun and
// Deno. They run whenever nats-server is on PATH (CI installs it); without it, the suite says which were skipped and
// the line that installs it. Tests that run over both relays (a bus and NATS) stay with the core, in
// interlink.test.ts; the helpers the files share (startNats, natsNode…) are in dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import * as fs from "node:fs";
import * as path from "node:path";
import {
  type Announcement,
  fingerprint,
  type Handed,
  type Identity,
  identityFromSeed,
  messagePayload,
  openRelay,
  ROSTER_CAP,
  ROSTER_PER_KEY_CAP,
  signAnnouncement,
  type SignedMessage,
  signMessage,
} from "./interlink.ts";
import { connectNats, NATS_STREAM, natsConsumer, natsInbox, natsPermissions, NatsRelay, natsSubject } from "./nats.ts";
import type { McpSession } from "./dev/harness.ts";
import {
  admittedIds,
  befriend,
  copyFromRepo,
  denoPath,
  eventOn,
  eventually,
  freePort,
  killGroup,
  makeNodeFiles,
  McpNode,
  msgIdOf,
  natsNode,
  type NatsServer,
  type NodeFiles,
  readNodeLog,
  REPO,
  runCliAsync,
  sealedBothWays,
  spawnAsync,
  startBus,
  startNats,
  stop,
  sweepAfterAll,
  systemTool,
  tmpDir,
  twoPeers,
} from "./dev/testkit.ts";

const NATS_TESTS = [
  "two agents (Bun and Deno) through one JetStream server run the task lifecycle",
  "kill -9 of an agent mid-stream loses and duplicates nothing",
  "a three-node cluster keeps delivering when the agent's server is killed; nothing acknowledged is lost",
  "a mixed setup (one agent on HTTP and NATS, one only on NATS) delivers exactly once",
  "doctor checks a NATS relay; a server without JetStream is a problem with a fix",
  "with the documented permission set, a node reads only its own routes; one that may not create the stream is told so",
  "one node's flood of roster entries cannot push another node's session off the NATS roster",
  "what a stopping session's last pull still gets is handed straight back: the route's next reader has it at once",
  "a NATS stream made by an earlier release (it drops the oldest per subject): used as it is, and alice holds bob's mail until his receipts come",
  "alice → bob → carol over NATS: carol's question reaches alice via bob, the answer comes back once, alice's cancel reaches carol",
  "a copy of interlink.ts alone given a nats:// URL says which file to fetch and where; the session runs on, its outbox keeps what it sends, and all of it goes once nats.ts is there",
  "a session killed before it acked its key's mail: the key's next session (Bun, Deno) is handed that mail back at once, and reads what follows from its first moments",
  "sealed both ways between a Bun and a Deno node: the stream holds each task's msg_id, never its text or task",
];
const NATS_SERVER = systemTool("nats-server", "/usr/sbin/nats-server", "NATS", NATS_TESTS);
// One at a time: each starts a few servers and two agents, and with many children at once Bun's test process was
// seen to stop reading some children's pipes (a nats-server's "ready" line, an agent's answer) for a minute.
const natsTest = NATS_SERVER ? test : test.skip;
// The two tests that mostly wait (an ack wait, a leader election) overlap each other, and nothing else.
const natsTestWaiting = NATS_SERVER ? test.concurrent : test.skip;

/** The process is still there (signal 0 tests without signalling). */
const alive = (pid: number): boolean => {
  try {
    return process.kill(pid, 0);
  } catch {
    return false;
  }
};

sweepAfterAll();

test.concurrent(
  "without a nats:// URL nothing NATS-related is loaded (Bun without auto-install, Deno offline)",
  async () => {
    const root = tmpDir();
    const lone = path.join(root, "interlink.ts"); // with nats.ts beside it, and no node_modules anywhere above it
    copyFromRepo(root, "interlink.ts", "nats.ts");
    const bob = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
    fs.writeFileSync(path.join(root, "peers.json"), JSON.stringify({ bob: { key: bob.publicKey } }));
    const port = await freePort(); // nothing listens there
    const send = async (runtime: "bun" | "deno", url: string) => {
      const argv = runtime === "bun"
        ? [process.execPath, "--no-install", lone]
        : [denoPath(), "run", "--cached-only", "-A", "--quiet", lone];
      const r = await spawnAsync(argv[0], [
        ...argv.slice(1),
        "send",
        "bob",
        "hi",
        "--url",
        url,
        "--state",
        path.join(root, `s-${runtime}-${url.slice(0, 4)}`),
      ], {
        cwd: root,
        env: {
          ...process.env,
          INTERLINK_KEY: path.join(root, "id.key"),
          INTERLINK_PEERS: path.join(root, "peers.json"),
          INTERLINK_CONFIG: path.join(root, "config.json"),
          DENO_DIR: path.join(root, "empty-deno-dir"), // no npm package cached, and none may be fetched
        },
      });
      return r.stdout + r.stderr;
    };
    await runCliAsync("bun", ["keygen", "--out", path.join(root, "id.key")]);
    for (const runtime of ["bun", "deno"] as const) {
      const http = await send(runtime, `http://127.0.0.1:${port}`);
      expect(http, runtime).toContain("queued since");
      expect(http, runtime).not.toMatch(/cannot load|nats/i);
      // The same command with a NATS relay is the first to reach for the NATS packages (here they cannot load).
      expect(await send(runtime, `nats://127.0.0.1:${port}`), runtime).toMatch(
        /cannot load (npm:)?@nats-io\/transport-node@3\.4\.0/,
      );
    }
  },
  60_000,
);

test("docs/nats.md's permission set is the one in the code", () => {
  const readme = fs.readFileSync(path.join(REPO, "docs", "nats.md"), "utf8");
  const perms = natsPermissions("<key>");
  for (const subject of [...perms.publish.allow, ...perms.subscribe.allow]) {
    expect(readme).toMatch(new RegExp(`^  ${subject.replace(/[.*+?^${}()|[\]\\$]/g, "\\$&")}( |$)`, "m"));
  }
});

// A copy of interlink.ts alone is a whole node over HTTP relays; NATS is nats.ts beside it, and the copy says so.
natsTest(NATS_TESTS[10], async () => {
  const { root, A, B } = await twoPeers();
  const lone = path.join(root, "lone");
  copyFromRepo(lone, "interlink.ts"); // alice runs this copy: nothing beside it, no node_modules above it
  const port = await freePort();
  const url = `nats://127.0.0.1:${port}`;
  const env = { INTERLINK_DELIVERY: "inbox", INTERLINK_AUTOSTART_BUS: "0" };
  const alice = await McpNode.start("bun", A, url, env, path.join(lone, "interlink.ts"));
  let bob: McpNode | undefined;
  let nats: NatsServer | undefined;
  try {
    const fetch =
      `${url} is a NATS relay, and NATS support is not part of interlink.ts: it is nats.ts in interlink's ` +
      `repository, beside interlink.ts. Clone the repository, or fetch that file to ${path.join(lone, "nats.ts")}, ` +
      "to use it; until then what is sent through it waits in the outbox, and HTTP relays work without it.";
    const first = await alice.ok("send_message", { to: "bob", text: "before nats.ts" });
    expect(first).toMatch(
      /^msg_id \S+ to bob: queued since .*it stays in the durable outbox and is retried automatically/,
    );
    // The session says what to fetch and where, in its log (which Claude Code keeps) and in list_pending, and runs on.
    await eventually(() => alice.stderr.some((l) => l.includes(`cannot poll ${url}: ${fetch}`)), "the log says so");
    await eventually(async () => (await alice.ok("list_pending")).includes(fetch), "list_pending says so");
    // The file is fetched and a relay answers there: what waited goes, then what is sent next, in order; no restart.
    copyFromRepo(lone, "nats.ts");
    [nats] = await startNats(root, 1, { port });
    bob = await natsNode("deno", B, [url]);
    await alice.ok("send_message", { to: "bob", text: "after nats.ts" });
    await eventually(() => admittedIds(B).length >= 2, "bob has both", 60_000);
    const texts = readNodeLog(B.stateDir).filter((r) => r.t === "in").map((r) => r.msg.text);
    expect(texts).toEqual(["before nats.ts", "after nats.ts"]);
    await eventually(async () => (await alice.ok("list_pending")).includes("the outbox is empty"), "alice's is empty");
    expect(fs.readdirSync(lone).sort()).toEqual(["interlink.ts", "nats.ts"]); // nothing else written beside it
  } finally {
    await Promise.allSettled([alice.close(), bob?.close()]);
    nats?.kill();
  }
}, 120_000);

describe("NATS JetStream as the relay", () => {
  natsTest(NATS_TESTS[5], async () => {
    const { root, A, B } = await twoPeers();
    const [nats] = await startNats(root, 1, {
      accounts: {
        TEAM: {
          jetstream: "enabled",
          users: [
            { user: "admin", password: "admin" },
            { user: "alice", password: "a", permissions: natsPermissions(A.id.publicKey) },
            { user: "bob", password: "b", permissions: natsPermissions(B.id.publicKey) },
          ],
        },
      },
    });
    const as = (user: string) => nats.url.replace("nats://", `nats://${user}@`);
    // A node may not create the stream: it says what it lacks, and where the docs say what to grant.
    await expect(connectNats(as("alice:a"), A.id.publicKey)).rejects.toThrow(
      /the NATS account may not use the stream INTERLINK \(Permissions Violation .*STREAM\.CREATE\.INTERLINK.*docs\/nats\.md, "Who may read a route"/,
    );
    (await connectNats(as("admin:admin"))).nc.close(); // the admin creates the stream and the bucket
    // Without its own inbox prefix, a node's user cannot even ask: the replies would come where others could listen.
    await expect(connectNats(as("alice:a"))).rejects.toThrow(/may not use JetStream .*Subscription to "_INBOX\./);
    const [alice, bob] = await Promise.all([natsNode("bun", A, [as("alice:a")]), natsNode("deno", B, [as("bob:b")])]);
    const evil = await connectNats(as("alice:a"), A.id.publicKey); // alice's own credentials, against bob's mail
    try {
      await eventually(
        async () => (await alice.ok("discover", { peer: "bob" }).catch(() => "")).includes("  - bob · "),
        "roster",
      );
      const sent = await alice.ok("send_message", { to: "bob", text: "for bob only" });
      await eventually(async () => (await bob.ok("check_inbox")).includes("for bob only"), "bob reads his route");
      await eventually(
        async () => (await alice.ok("message_status", { msg_id: msgIdOf(sent) })).includes("shown"),
        "receipt",
      );
      const bobRoute = `${B.id.publicKey}#bob`;
      const attempts: [string, () => Promise<unknown>][] = [
        ["a consumer on bob's subject", () =>
          evil.jsm.consumers.add("INTERLINK", {
            durable_name: "evil",
            filter_subject: natsSubject(bobRoute),
            ack_policy: "explicit",
          })],
        ["bob's roster entry", () => evil.kv.put(`${B.id.publicKey}.Ym9i`, "{}")],
      ];
      for (const [what, attempt] of attempts) await expect(attempt(), what).rejects.toThrow(/Permissions Violation/);
      // Nor can she listen in on the replies that carry bob's pulled messages, or on anyone's acks.
      for (const subject of ["_INBOX.>", `${natsInbox(B.id.publicKey)}.>`, "$JS.ACK.>", ">"]) {
        const sub = (evil.nc as unknown as { subscribe(s: string): AsyncIterable<unknown> }).subscribe(subject);
        await expect(
          (async () => {
            for await (const _ of sub) return "received something";
          })(),
          subject,
        ).rejects.toThrow(/Permissions Violation/);
      }
      // Nor can alice find or guess the consumer that reads bob's route: its name comes from bob's signature.
      await expect(evil.js.consumers.get("INTERLINK", await natsConsumer(bobRoute))).rejects.toThrow(/not found/);
      expect(await natsConsumer(bobRoute, (d) => B.id.sign(d))).not.toBe(await natsConsumer(bobRoute));
    } finally {
      await evil.nc.close();
      await Promise.allSettled([alice.close(), bob.close()]);
      nats.kill();
    }
  }, 90_000);

  natsTest(NATS_TESTS[7], async () => {
    const root = tmpDir();
    const [nats] = await startNats(root);
    const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
    const sign = (data: Parameters<Identity["sign"]>[0]) => id.sign(data);
    const route = id.publicKey; // the bare key: read by whichever session of the node holds it
    const relay = new NatsRelay(nats.url, sign, id.publicKey);
    const { connect } = await import("@nats-io/transport-node");
    const { jetstreamManager } = await import("@nats-io/jetstream");
    const nc = await connect({ servers: nats.url.replace("nats://", "") });
    try {
      expect((await relay.recv(route, new AbortController().signal, 1_000)).items).toEqual([]); // opens the consumer
      // An ack wait of a minute: a message its reader leaves unacked would block the route that long.
      const jsm = await jetstreamManager(nc);
      const name = await natsConsumer(route, sign);
      const { config } = await jsm.consumers.info(NATS_STREAM, name);
      await jsm.consumers.update(NATS_STREAM, name, { ...config, ack_wait: 60_000 * 1e6 });
      const stopping = new AbortController();
      const abandoned = relay.recv(route, stopping.signal, 5_000);
      await eventually(async () => (await jsm.consumers.info(NATS_STREAM, name)).num_waiting > 0, "the pull waits");
      stopping.abort(); // the session stops; its connection stays open a moment longer (its goodbyes)
      expect((await abandoned).items).toEqual([]);
      const msg = await signMessage(id, { to: id.publicKey, text: "to the key" }, Date.now());
      await relay.send(route, msg, 5_000); // handed to the abandoned pull, the only one waiting
      // The next reader of the route (another session: another pull on the same consumer) has it at once.
      const reading = new AbortController();
      let got: Handed[] = [];
      await eventually(async () => (got = (await relay.recv(route, reading.signal, 1_000)).items).length > 0, "read");
      expect((got[0].payload as SignedMessage).msg_id).toBe(msg.msg_id);
      await got[0].ack();
    } finally {
      await Promise.allSettled([relay.close(), nc.close()]);
      nats.kill();
    }
  }, 90_000);

  // A message handed to a reader that is gone stays unacked until the consumer's ack wait runs out, and the route (one
  // unacked at a time) waits behind it: its next reader hands it back as it opens the route. Here the ack wait is ten
  // minutes, so what the next session reads can only have come through that hand-back.
  natsTest(NATS_TESTS[11], async () => {
    const root = tmpDir();
    const [nats] = await startNats(root);
    const sender = openRelay(nats.url);
    const toKey = async (from: NodeFiles, to: NodeFiles, text: string) => {
      const msg = await signMessage(from.id, { to: to.id.publicKey, text }, Date.now());
      await sender.send(to.id.publicKey, messagePayload(msg, `${from.id.publicKey}#${from.name}`), 5_000);
      return msg.msg_id;
    };
    const sessions: McpSession[] = [];
    try {
      await Promise.all((["bun", "deno"] as const).map(async (runtime) => {
        const [A, B] = await Promise.all(["alice", "bob"].map((n) => makeNodeFiles(path.join(root, runtime), n)));
        befriend(A, B);
        const ackWait = { INTERLINK_TEST_NATS_ACK_WAIT_MS: String(10 * 60_000) };
        // a1 reads alice's key and dies right after journaling what it took, before acking it.
        const a1 = await natsNode(runtime, A, [nats.url], {
          ...ackWait,
          INTERLINK_SESSION: "a1",
          INTERLINK_FAILPOINT: "agent-after-journal",
        });
        sessions.push(a1);
        await a1.ok("list_pending"); // open: a1 reads alice's key
        const held = await toKey(B, A, "taken, never acked");
        await eventually(
          () => admittedIds(A).includes(held) && !alive(a1.pid!),
          `${runtime}: a1 journaled it and died`,
        );
        const a2 = await natsNode(runtime, A, [nats.url], {
          ...ackWait,
          INTERLINK_SESSION: "a2",
          INTERLINK_DELIVERY: "channel",
        });
        sessions.push(a2);
        const next = await toKey(B, A, "right after a2 answered initialize");
        const shown = await a2.waitEvent((e) => e.meta.msg_id === next, 60_000);
        expect(shown.content, runtime).toContain("right after a2 answered initialize");
        // The one a1 journaled is a2's too (adopted from a1), once; its copy handed back was refused as a replay.
        await a2.waitEvent((e) => e.meta.msg_id === held);
        expect(a2.events.map((e) => e.meta.msg_id).filter((id) => id === held || id === next).sort(), runtime)
          .toEqual([held, next].sort());
        expect(admittedIds(A).sort(), runtime).toEqual([held, next].sort());
      }));
    } finally {
      await Promise.allSettled([...sessions.map((s) => s.close()), sender.close()]);
      nats.kill();
    }
  }, 120_000);

  natsTest(NATS_TESTS[6], async () => {
    const root = tmpDir();
    const [nats] = await startNats(root);
    const mallory = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
    const alice = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
    const flood = new NatsRelay(nats.url, undefined, mallory.publicKey);
    const reader = new NatsRelay(nats.url);
    try {
      const announce = async (who: Identity, session: string) =>
        await (who === mallory ? flood : reader).announce(
          await signAnnouncement(who, "x", Date.now(), { session_id: session, cwd: "/", git_root: "", summary: "" }),
        );
      await announce(alice, "a1"); // written first: the oldest entry
      for (let i = 0; i < ROSTER_CAP + 200; i++) await announce(mallory, `junk-${i}`);
      const listed = (await reader.roster(30_000)) as Announcement[];
      expect(listed.filter((a) => a.pubkey === alice.publicKey).length).toBe(1);
      expect(listed.filter((a) => a.pubkey === mallory.publicKey).length).toBe(ROSTER_PER_KEY_CAP); // its newest, no more
    } finally {
      await Promise.allSettled([flood.close(), reader.close()]);
      nats.kill();
    }
  }, 120_000);

  natsTest(NATS_TESTS[0], async () => {
    const { root, A, B } = await twoPeers();
    const [nats] = await startNats(root);
    const [alice, bob] = await Promise.all([natsNode("bun", A, [nats.url]), natsNode("deno", B, [nats.url])]);
    try {
      await eventually(
        async () => (await alice.ok("discover", { peer: "bob" })).includes("  - bob · "),
        "bob is on the NATS roster",
      );
      const req = await alice.ok("send_message", { to: "bob", text: "count the deps", task_id: "deps" });
      expect(req).toContain(`sent at`);
      await eventually(
        async () => (await bob.ok("check_inbox", { peek: true })).includes("count the deps"),
        "bob has it",
      );
      await bob.ok("check_inbox");
      const q = await bob.ok("send_message", {
        to: "alice",
        text: "which repo?",
        task_id: "deps",
        status: "needs_input",
      });
      await eventually(
        async () => (await alice.ok("list_tasks")).includes(`BLOCKED on bob's question ${msgIdOf(q)}`),
        "asked",
      );
      await alice.ok("send_message", { to: "bob", text: "this one", task_id: "deps", in_reply_to: msgIdOf(q) });
      await eventually(async () => (await bob.ok("check_inbox")).includes("this one"), "answered");
      await bob.ok("send_message", { to: "alice", text: "12", task_id: "deps", status: "result" });
      await eventually(async () => (await alice.ok("list_tasks")).includes("status result; closed"), "closed at alice");
      expect(await bob.ok("list_tasks")).toContain("status result; closed");
      // Receipts travel over NATS too.
      await eventually(
        async () => (await alice.ok("message_status", { msg_id: msgIdOf(req) })).includes("shown to its model"),
        "receipts",
      );
      expect(admittedIds(B).length).toBe(new Set(admittedIds(B)).size);
      // A clean exit unregisters: bob's session leaves the NATS roster at once.
      await bob.close();
      expect(await alice.ok("discover", { peer: "bob" })).toBe("no session of 'bob' is on the roster");
    } finally {
      await Promise.allSettled([alice.close(), bob.close()]);
      nats.kill();
    }
  }, 90_000);

  natsTestWaiting(NATS_TESTS[1], async () => {
    const { root, A, B } = await twoPeers();
    const [nats] = await startNats(root);
    const alice = await natsNode("bun", A, [nats.url]);
    let bob = await natsNode("deno", B, [nats.url]);
    try {
      const sent: string[] = [];
      const sending = (async () => {
        for (let i = 0; i < 30; i++) {
          sent.push(msgIdOf(await alice.ok("send_message", { to: "bob", text: `n${i}`, session: "bob" })));
        }
      })();
      await eventually(() => admittedIds(B).length >= 5, "bob is mid-stream");
      killGroup(bob.pid!);
      await bob.close().catch(() => {});
      bob = await natsNode("deno", B, [nats.url]);
      await sending;
      await eventually(() => admittedIds(B).length >= 30, "bob has all 30", 40_000);
      expect(admittedIds(B).sort()).toEqual([...sent].sort());
      // And the model gets each exactly once.
      const unread = await bob.ok("check_inbox", { limit: 200 });
      expect((unread.match(/<interlink-message /g) ?? []).length).toBe(30);
      for (const id of sent) expect(unread.split(`msg_id="${id}"`).length - 1).toBe(1);
    } finally {
      await Promise.allSettled([alice.close(), bob.close()]);
      nats.kill();
    }
  }, 120_000);

  natsTestWaiting(NATS_TESTS[2], async () => {
    const { root, A, B } = await twoPeers();
    const servers = await startNats(root, 3);
    const [alice, bob] = await Promise.all([
      natsNode("bun", A, [servers[0].url], { INTERLINK_NATS_REPLICAS: "3" }),
      natsNode("deno", B, [servers[1].url], { INTERLINK_NATS_REPLICAS: "3" }),
    ]);
    try {
      const ids: string[] = [];
      for (let i = 0; i < 10; i++) {
        ids.push(msgIdOf(await alice.ok("send_message", { to: "bob", text: `before ${i}`, session: "bob" })));
      }
      servers[0].kill(); // alice's server
      // At once: until alice's client finds another server, each call waits out its 2 s answer deadline.
      ids.push(
        ...await Promise.all(
          Array.from(
            { length: 10 },
            (_, i) => alice.ok("send_message", { to: "bob", text: `after ${i}`, session: "bob" }).then(msgIdOf),
          ),
        ),
      );
      // Everything the relay acknowledged to alice (a "sent" record) reaches bob; the rest follows from her outbox.
      await eventually(
        async () => (await alice.ok("list_pending")).includes("the outbox is empty"),
        "alice's outbox drained",
        60_000,
      );
      await eventually(() => admittedIds(B).length >= 20, "bob has all 20", 60_000);
      expect(admittedIds(B).sort()).toEqual([...ids].sort());
    } finally {
      await Promise.allSettled([alice.close(), bob.close()]);
      for (const s of servers) s.kill();
    }
  }, 150_000);

  natsTest(NATS_TESTS[3], async () => {
    const { root, A, B } = await twoPeers();
    const [nats] = await startNats(root);
    const bus = await startBus("bun", path.join(root, "bus"));
    const [alice, bob] = await Promise.all([
      natsNode("bun", A, [bus.url, nats.url]),
      natsNode("deno", B, [nats.url]),
    ]);
    try {
      const toBob = await alice.ok("send_message", { to: "bob", text: "both relays", session: "bob" });
      expect(toBob).toMatch(/accepted by http:\/\/127\.0\.0\.1:\d+, nats:\/\/127\.0\.0\.1:\d+/);
      const toAlice = await bob.ok("send_message", { to: "alice", text: "nats only", session: "alice" });
      await eventually(async () => (await bob.ok("check_inbox", { peek: true })).includes("both relays"), "bob has it");
      await eventually(
        async () => (await alice.ok("check_inbox", { peek: true })).includes("nats only"),
        "alice has it",
      );
      // alice's copy on the HTTP bus waits there (bob never reads that bus); on NATS, bob read it once.
      await eventually(
        async () => (await alice.ok("message_status", { msg_id: msgIdOf(toBob) })).includes("delivered"),
        "receipt",
      );
      expect(admittedIds(B)).toEqual([msgIdOf(toBob)]);
      expect(admittedIds(A)).toEqual([msgIdOf(toAlice)]);
    } finally {
      await Promise.allSettled([alice.close(), bob.close()]);
      nats.kill();
      await stop(bus);
    }
  }, 90_000);

  natsTest(NATS_TESTS[4], async () => {
    const root = tmpDir();
    const A = await makeNodeFiles(root, "alice");
    const [js] = await startNats(path.join(root, "js"));
    const [plain] = await startNats(path.join(root, "plain"), 1, { jetstream: false });
    try {
      const env = { INTERLINK_KEY: A.keyFile, INTERLINK_PEERS: A.peersFile, INTERLINK_STATE: A.stateDir };
      const ok = (await runCliAsync("deno", ["doctor"], { env: { ...env, INTERLINK_URL: js.url } })).stdout;
      expect(ok).toMatch(
        /ok +NATS relay nats:\/\/127\.0\.0\.1:\d+ answers \(round trip \d+ ms; connected with JetStream, stream INTERLINK and bucket interlink-roster ready/,
      );
      const bad = await runCliAsync("bun", ["doctor"], { env: { ...env, INTERLINK_URL: plain.url } });
      expect(bad.stdout).toMatch(/PROBLEM +NATS relay .* is not usable: JetStream is not enabled/);
      expect(bad.stdout).toContain("fix: start nats-server with JetStream");
    } finally {
      js.kill();
      plain.kill();
    }
  }, 60_000);
});

describe("flow control over a NATS stream that drops", () => {
  natsTest(
    NATS_TESTS[8],
    async () => {
      const { root, A, B } = await twoPeers();
      const [nats] = await startNats(root);
      // The stream as an earlier release made it: discard old, 8 per subject here.
      const { connect } = await import("@nats-io/transport-node");
      const { jetstreamManager } = await import("@nats-io/jetstream");
      const nc = await connect({ servers: nats.url.replace("nats://", "") });
      const jsm = await jetstreamManager(nc);
      await jsm.streams.add(
        {
          name: NATS_STREAM,
          subjects: ["interlink.in.>"],
          retention: "workqueue",
          storage: "file",
          max_msgs_per_subject: 8,
          discard: "old",
        } as Parameters<typeof jsm.streams.add>[0],
      );
      const alice = await natsNode("bun", A, [nats.url], { INTERLINK_TEST_SEND_WINDOW: "6" });
      let bob: McpSession | undefined;
      try {
        const texts = Array.from({ length: 30 }, (_, i) => `while asleep ${i}`);
        const answers = [];
        for (const text of texts) answers.push(await alice.ok("send_message", { to: "bob", text }));
        expect(answers.at(-1)).toContain("it waits in the outbox: bob has confirmed none of the 6 sent before it");
        bob = await natsNode("deno", B, [nats.url]);
        await eventually(() => admittedIds(B).length >= texts.length, "bob took all 30", 60_000);
        expect(readNodeLog(B.stateDir).filter((r) => r.t === "in").map((r) => r.msg.text)).toEqual(texts);
        const config = (await jsm.streams.info(NATS_STREAM)).config;
        expect([config.discard, config.max_msgs_per_subject]).toEqual(["old", 8]); // never changed by a node
      } finally {
        await Promise.allSettled([alice.close(), bob?.close(), nc.close()]);
        nats.kill();
      }
    },
    120_000,
  );
});

describe("delegation across hops over NATS JetStream: alice on Bun, bob on Deno, carol on Bun", () => {
  natsTest(NATS_TESTS[9], async () => {
    const root = tmpDir();
    const [server] = await startNats(root);
    const [A, B, C] = await Promise.all(["alice", "bob", "carol"].map((n) => makeNodeFiles(root, n)));
    befriend(A, B);
    befriend(B, C);
    const channel = { INTERLINK_DELIVERY: "channel" };
    const [alice, bob, carol] = await Promise.all([
      natsNode("bun", A, [server.url], channel),
      natsNode("deno", B, [server.url], channel),
      natsNode("bun", C, [server.url], channel),
    ]);
    const fp = (f: NodeFiles) => fingerprint(f.id.publicKey);
    try {
      const req = await alice.ok("send_message", { to: "bob", text: "build the site", task_id: "n-site" });
      await eventOn(bob, (e) => e.meta.msg_id === msgIdOf(req));
      const sub = await bob.ok("send_message", {
        to: "carol",
        text: "draw the logo",
        task_id: "n-logo",
        parent_task_id: "n-site",
      });
      await eventOn(carol, (e) => e.meta.msg_id === msgIdOf(sub));
      const q = await carol.ok("send_message", {
        to: "bob",
        text: "which sizes?",
        task_id: "n-logo",
        status: "needs_input",
      });
      const asked = await eventOn(alice, (e) => e.meta.task_id === "n-site" && e.meta.status === "needs_input");
      expect(asked.content).toBe(`[task n-site · needs_input] carol (${fp(C)}) asks, via bob: which sizes?`);
      await alice.ok("send_message", { to: "bob", text: "64 px", task_id: "n-site", in_reply_to: asked.meta.msg_id });
      const answer = await eventOn(carol, (e) => e.meta.in_reply_to === msgIdOf(q));
      expect(answer.content).toBe(`[task n-logo] alice (${fp(A)}) answers, via bob: 64 px`);
      // The chain crossed the relay whole: carol's record of the request holds it, verified.
      const opened = readNodeLog(C.stateDir).find((r) => r.t === "in" && r.msg.task_id === "n-logo");
      expect(opened.chain.keys).toEqual([A.id.publicKey, B.id.publicKey]);
      await alice.ok("cancel_task", { to: "bob", task_id: "n-site" });
      expect((await eventOn(carol, (e) => e.meta.task_id === "n-logo" && e.meta.status === "canceled")).content)
        .toStartWith(`[task n-logo · canceled] canceled: alice (${fp(A)}) canceled task n-site`);
      expect(carol.events.filter((e) => e.meta.in_reply_to === msgIdOf(q)).length).toBe(1);
    } finally {
      await Promise.allSettled([alice.close(), bob.close(), carol.close()]);
      server.kill();
    }
  }, 120_000);
});

natsTest(NATS_TESTS[12], async () => {
  const root = tmpDir();
  const [nats] = await startNats(root);
  try {
    await sealedBothWays(nats.url, root, { INTERLINK_AUTOSTART_BUS: "0" }); // the folder holds the JetStream store
  } finally {
    nats.kill();
  }
}, 180_000);
