// Tests for interlink.ts. Run with the README's command: `npx -y bun@1.4.5 test`.
// Everything here is real: real files, real child processes under Bun and Deno,
// a real bus on a loopback port, the official MCP SDK client over stdio.

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import {
  addPeer,
  b64urlDecode,
  b64urlEncode,
  canonicalBytes,
  announcementBytes,
  decide,
  foldTask,
  hasSmallOrder,
  identityFromSeed,
  JsonlWriter,
  lifecycleError,
  LockedError,
  parsePeers,
  parseSignedMessage,
  PidLock,
  readJsonl,
  removePeer,
  ReplayMemory,
  scanJsonl,
  signMessage,
  verifyAnnouncement,
  verifyMessage,
  FRESH_FUTURE_MS,
  FRESH_PAST_MS,
  type Identity,
  type Peers,
  type SignedMessage,
  type TaskRow,
} from "./interlink.ts";

const REPO = import.meta.dir;
const SCRIPT = path.join(REPO, "interlink.ts");
export const DENO_VERSION = "2.9.6";

const VECTORS_TEXT = fs.readFileSync(path.join(REPO, "vectors", "v2.json"), "utf8");
const VECTORS = JSON.parse(VECTORS_TEXT);

function tmpDir(prefix = "interlink-test-"): string {
  return fs.mkdtempSync(path.join(os.tmpdir(), prefix));
}

/** The Deno binary: $INTERLINK_TEST_DENO, `deno` on PATH, or the pinned npm package via npx. */
let denoPathCache: string | undefined;
export function denoPath(): string {
  if (denoPathCache) return denoPathCache;
  const fromEnv = process.env.INTERLINK_TEST_DENO || Bun.which("deno");
  if (fromEnv) return (denoPathCache = fromEnv);
  const r = spawnSync("npx", ["-y", `deno@${DENO_VERSION}`, "eval", "console.log(Deno.execPath())"], { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`cannot get Deno ${DENO_VERSION} through npx: ${r.stderr}`);
  return (denoPathCache = r.stdout.trim().split("\n").at(-1)!);
}

/** argv prefix that runs interlink.ts under the named runtime. */
export function runtimeArgv(runtime: "bun" | "deno"): string[] {
  return runtime === "bun" ? [process.execPath, SCRIPT] : [denoPath(), "run", "-A", "--quiet", SCRIPT];
}

function runCli(runtime: "bun" | "deno", args: string[], opts: { input?: string; env?: Record<string, string> } = {}) {
  const [cmd, ...pre] = runtimeArgv(runtime);
  const r = spawnSync(cmd, [...pre, ...args], { input: opts.input, encoding: "utf8", env: { ...process.env, ...opts.env }, cwd: REPO, timeout: 60_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");

const ALICE = VECTORS.keys.alice;
const BOB = VECTORS.keys.bob;
const EVE = VECTORS.keys.eve;

let alice: Identity, bob: Identity, eve: Identity;
beforeAll(async () => {
  alice = await identityFromSeed(b64urlDecode(ALICE.secret_b64, 32, "seed"));
  bob = await identityFromSeed(b64urlDecode(BOB.secret_b64, 32, "seed"));
  eve = await identityFromSeed(b64urlDecode(EVE.secret_b64, 32, "seed"));
});

// ----------------------------------------------------------------------------
describe("signing vectors from the independent implementation", () => {
  test("the repo copy is byte-identical to ../shared when that exists", () => {
    const shared = path.join(REPO, "..", "shared", "vectors", "v2.json");
    if (fs.existsSync(shared)) expect(fs.readFileSync(shared, "utf8")).toBe(VECTORS_TEXT);
    expect(VECTORS.valid.length).toBeGreaterThan(0);
    expect(VECTORS.invalid.length).toBeGreaterThan(0);
  });

  test("seeds derive the published public keys and fingerprints", () => {
    for (const [who, id] of [[ALICE, alice], [BOB, bob], [EVE, eve]] as const) {
      expect(id.publicKey).toBe(who.public_b64);
      expect(id.fingerprint).toBe(who.fingerprint);
    }
  });

  for (const c of VECTORS.valid) {
    test(`valid: ${c.name} verifies to its sender and reproduces canonical_hex and sig`, async () => {
      const msg = parseSignedMessage(c.message);
      expect(await verifyMessage(msg)).toBeNull();
      expect(msg.from).toBe(c.message.from);
      expect(hex(canonicalBytes(msg))).toBe(c.canonical_hex);
      // Ed25519 is deterministic: signing the same fields with the seed gives the same signature.
      const signer = [alice, bob, eve].find((i) => i.publicKey === msg.from)!;
      expect(await signer.sign(canonicalBytes(msg))).toBe(c.message.sig);
    });
  }

  for (const c of VECTORS.invalid) {
    test(`invalid: ${c.name} is rejected (${c.why})`, async () => {
      let verdict: string | null;
      try {
        verdict = await verifyMessage(parseSignedMessage(c.message));
      } catch (e) {
        verdict = (e as Error).message;
      }
      expect(verdict).not.toBeNull();
    });
  }

  test("announcement: verifies and reproduces canonical_hex", async () => {
    const a = VECTORS.announce[0];
    expect(await verifyAnnouncement(a)).toBeNull();
    expect(hex(announcementBytes(a))).toBe(a.canonical_hex);
    expect(await verifyAnnouncement({ ...a, name: "mallory" })).not.toBeNull();
  });

  test("every vector gets the right verdict from `interlink.ts verify` under Bun and Deno", () => {
    const valid = [...VECTORS.valid.map((c: { message: unknown }) => c.message), VECTORS.announce[0]];
    const invalid = VECTORS.invalid.map((c: { message: unknown }) => c.message);
    const lines = (xs: unknown[]) => xs.map((x) => JSON.stringify(x)).join("\n") + "\n";
    for (const rt of ["bun", "deno"] as const) {
      const ok = runCli(rt, ["verify"], { input: lines(valid) });
      expect({ rt, code: ok.code, stderr: ok.stderr }).toEqual({ rt, code: 0, stderr: "" });
      expect(ok.stdout.trim().split("\n")).toEqual(valid.map((m: { from?: string; pubkey?: string }) => `ok ${m.from ?? m.pubkey}`));
      const bad = runCli(rt, ["verify"], { input: lines(invalid) });
      expect(bad.code).toBe(1);
      const out = bad.stdout.trim().split("\n");
      expect(out.length).toBe(invalid.length);
      for (const line of out) expect(line).toStartWith("invalid: ");
      // One bad line among good ones still fails the run, and costs no other line.
      const mixed = runCli(rt, ["verify"], { input: lines([valid[0], invalid[0], valid[1]]) });
      expect(mixed.code).toBe(1);
      expect(mixed.stdout.trim().split("\n").map((l) => l.split(" ")[0])).toEqual(["ok", "invalid:", "ok"]);
    }
  }, 120_000);
});

// ----------------------------------------------------------------------------
describe("attacks on signed messages", () => {
  let base: SignedMessage;
  beforeAll(async () => {
    base = await signMessage(alice, { to: bob.publicKey, text: "install the deps", task_id: "t1", status: "update", in_reply_to: "q1" }, 1_767_225_600_000);
  });
  const rejected = async (m: unknown) => {
    try {
      return (await verifyMessage(parseSignedMessage(m))) !== null;
    } catch {
      return true;
    }
  };

  test("an untouched message verifies (so the attacks below fail for the right reason)", async () => {
    expect(await rejected(base)).toBe(false);
  });

  for (const [name, change] of [
    ["tampered text", { text: "rm -rf /" }],
    ["tampered ts", { ts: 1_767_225_600_001 }],
    ["flipped status to canceled", { status: "canceled" }],
    ["dropped status", { status: undefined }],
    ["moved to another task_id", { task_id: "t2" }],
    ["dropped task_id", { task_id: undefined }],
    ["moved in_reply_to to another question", { in_reply_to: "q2" }],
    ["re-addressed to eve", { to: EVE.public_b64 }],
    ["re-typed into a knock", { kind: "pair_request" }],
    ["re-typed into an accept", { kind: "pair_accept" }],
    ["new msg_id to dodge replay memory", { msg_id: "fresh" }],
  ] as const) {
    test(`${name} is rejected`, async () => {
      expect(await rejected({ ...base, ...change })).toBe(true);
    });
  }

  test("Eve signs, then claims to be Alice: forged sender is rejected", async () => {
    const evil = await signMessage(eve, { to: bob.publicKey, text: "hi, it's alice" }, 1_767_225_600_000);
    expect(await rejected({ ...evil, from: alice.publicKey })).toBe(true);
  });

  test("boundary shift: moving bytes from text into task_id breaks the signature", async () => {
    const m = await signMessage(alice, { to: bob.publicKey, text: "ab", task_id: "c" }, 1_767_225_600_000);
    expect(await rejected(m)).toBe(false);
    expect(await rejected({ ...m, text: "a", task_id: "bc" })).toBe(true);
  });

  test("a v1-domain signature is not a v2 signature", async () => {
    const v1 = VECTORS.invalid.find((c: { name: string }) => c.name === "v1 signature");
    expect(await rejected(v1.message)).toBe(true);
  });

  // libsodium's blocklist: every encoding of a point of order 1, 2, 4 or 8, canonical or not.
  const SMALL_ORDER = [
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
  ];

  test("every small-order encoding (with either sign bit) is detected; real keys are not", async () => {
    for (const h of SMALL_ORDER) {
      const b = Uint8Array.from(Buffer.from(h, "hex"));
      expect(hasSmallOrder(b)).toBe(true);
      b[31] ^= 0x80;
      expect(hasSmallOrder(b)).toBe(true);
    }
    for (let i = 0; i < 50; i++) {
      const id = await identityFromSeed(crypto.getRandomValues(new Uint8Array(32)));
      expect(hasSmallOrder(b64urlDecode(id.publicKey, 32, "k"))).toBe(false);
    }
  });

  test("small-order sender key with R = identity and S = 0 'verifies' in WebCrypto, but not here", async () => {
    const weak = VECTORS.invalid.find((c: { name: string }) => c.name === "small-order sender key").message;
    // WebCrypto alone accepts it, which is why the strict check exists:
    const key = await crypto.subtle.importKey("raw", b64urlDecode(weak.from, 32, "k"), { name: "Ed25519" }, false, ["verify"]);
    const m = parseSignedMessage(weak);
    expect(await crypto.subtle.verify("Ed25519", key, b64urlDecode(weak.sig, 64, "s"), canonicalBytes(m))).toBe(true);
    expect(await verifyMessage(m)).toBe("public key is a small-order point");
  });

  test("a small-order R in an otherwise real signature is rejected", async () => {
    const sig = b64urlDecode(base.sig, 64, "s");
    sig.set(Buffer.from(SMALL_ORDER[2], "hex"), 0);
    expect(await verifyMessage({ ...base, sig: b64urlEncode(sig) })).toBe("signature R is a small-order point");
  });

  test("non-canonical S (S + L, the malleable twin) is rejected", async () => {
    const L = 2n ** 252n + 27742317777372353535851937790883648493n;
    const sig = b64urlDecode(base.sig, 64, "s");
    let s = 0n;
    for (let i = 63; i >= 32; i--) s = (s << 8n) | BigInt(sig[i]);
    s += L;
    for (let i = 32; i < 64; i++) {
      sig[i] = Number(s & 0xffn);
      s >>= 8n;
    }
    expect(await verifyMessage({ ...base, sig: b64urlEncode(sig) })).toBe("signature S is not reduced (S >= L)");
  });

  test("truncated, padded, non-canonical and garbage signatures and keys are malformed", () => {
    const cases = [
      { sig: base.sig.slice(0, -1) },
      { sig: base.sig + "A" },
      { sig: base.sig + "==" },
      { sig: "!".repeat(86) },
      { sig: 42 },
      { from: alice.publicKey.slice(0, 42) },
      { from: alice.publicKey + "=" },
      { from: alice.publicKey.replace(/.$/, alice.publicKey.endsWith("E") ? "F" : "E") }, // same bytes, stray low bits
      { to: "not base64!" },
      { from: null },
    ];
    for (const c of cases) expect(() => parseSignedMessage({ ...base, ...c })).toThrow();
  });

  test("wrong types, unknown kind and unknown status are a clear error, never a crash", () => {
    expect(() => parseSignedMessage(null)).toThrow("not a JSON object");
    expect(() => parseSignedMessage([])).toThrow("not a JSON object");
    expect(() => parseSignedMessage({ ...base, kind: "admin" })).toThrow('unknown kind "admin"');
    expect(() => parseSignedMessage({ ...base, status: "done" })).toThrow('unknown status "done"');
    expect(() => parseSignedMessage({ ...base, ts: -1 })).toThrow("ts");
    expect(() => parseSignedMessage({ ...base, ts: 1.5 })).toThrow("ts");
    expect(() => parseSignedMessage({ ...base, ts: "1767225600000" })).toThrow("ts");
    expect(() => parseSignedMessage({ ...base, text: undefined })).toThrow('"text" is missing');
    expect(() => parseSignedMessage({ ...base, task_id: 7 })).toThrow('"task_id" is not a string');
    expect(() => parseSignedMessage({ ...base, msg_id: "" })).toThrow("msg_id");
  });

  test("absent kind means message and null optional fields mean none", () => {
    const { kind: _k, ...noKind } = base;
    expect(parseSignedMessage(noKind).kind).toBe("message");
    const m = parseSignedMessage({ ...base, in_reply_to: null, extra: "ignored" });
    expect(m.in_reply_to).toBeUndefined();
    expect("extra" in m).toBe(false);
  });
});

// ----------------------------------------------------------------------------
describe("the gate", () => {
  const NOW = 1_767_225_600_000;
  let peers: Peers;
  const sign = (id: Identity, draft: Partial<Parameters<typeof signMessage>[1]>, ts = NOW) =>
    signMessage(id, { to: bob.publicKey, text: "hello", ...draft }, ts);
  beforeAll(() => {
    peers = parsePeers(JSON.stringify({ alice: { key: alice.publicKey } }));
  });
  const gate = (payload: unknown, replay = new ReplayMemory(), knocked = new Set<string>(), now = NOW) =>
    decide(payload, bob.publicKey, peers, now, replay, knocked);

  test("a peer's signed message is delivered under its petname, with its task fields", async () => {
    const m = await sign(alice, { task_id: "t1", status: "needs_input" });
    const v = await gate(m);
    expect(v.verdict).toBe("deliver");
    if (v.verdict === "deliver") {
      expect(v.petname).toBe("alice");
      expect(v.msg.task_id).toBe("t1");
      expect(v.msg.status).toBe("needs_input");
    }
  });

  test("reject reasons: malformed, bad_signature, wrong_recipient, not_allowlisted, stale, replay, unexpected_kind", async () => {
    const reason = async (p: Promise<Awaited<ReturnType<typeof gate>>>) => {
      const v = await p;
      return v.verdict === "reject" ? v.reason : v.verdict;
    };
    expect(await reason(gate("not an object"))).toBe("malformed");
    expect(await reason(gate({ ...(await sign(alice, {})), text: "tampered" }))).toBe("bad_signature");
    expect(await reason(gate(await sign(alice, { to: eve.publicKey })))).toBe("wrong_recipient");
    expect(await reason(gate(await sign(eve, {})))).toBe("not_allowlisted");
    expect(await reason(gate(await sign(alice, {}, NOW + FRESH_FUTURE_MS + 1)))).toBe("stale");
    const replay = new ReplayMemory();
    const m = await sign(alice, {});
    replay.remember(m.from, m.msg_id, m.ts, NOW);
    expect(await reason(gate(m, replay))).toBe("replay");
    expect(await reason(gate(await sign(eve, { kind: "pair_accept", text: "eve" })))).toBe("unexpected_kind");
  });

  test("Eve signs, then claims Alice's key in `from`: rejected as a bad signature, never delivered as alice", async () => {
    const m = await sign(eve, {});
    const v = await gate({ ...m, from: alice.publicKey });
    expect(v.verdict === "reject" && v.reason).toBe("bad_signature");
  });

  test("a stranger's knock is held for the operator with only a sanitized name", async () => {
    const v = await gate(await sign(eve, { kind: "pair_request", text: 'eve <b>"laptop"</b>\n[task x · result]' }));
    expect(v.verdict).toBe("pair_request");
    if (v.verdict === "pair_request") expect(v.claimedName).toBe("eve blaptop/b task x · result");
  });

  test("a pair_accept counts only from a key we knocked", async () => {
    const accept = await sign(eve, { kind: "pair_accept", text: "eve" });
    expect((await gate(accept)).verdict).toBe("reject");
    expect((await gate(accept, new ReplayMemory(), new Set([eve.publicKey]))).verdict).toBe("pair_accept");
  });

  test("freshness edges: exactly 60 s ahead and exactly 24 h old pass; one ms more does not", async () => {
    expect((await gate(await sign(alice, {}, NOW + FRESH_FUTURE_MS))).verdict).toBe("deliver");
    expect((await gate(await sign(alice, {}, NOW + FRESH_FUTURE_MS + 1))).verdict).toBe("reject");
    expect((await gate(await sign(alice, {}, NOW - FRESH_PAST_MS))).verdict).toBe("deliver");
    expect((await gate(await sign(alice, {}, NOW - FRESH_PAST_MS - 1))).verdict).toBe("reject");
  });

  test("the gate checks the signature before the allowlist: a stranger's tampered message is bad_signature", async () => {
    const v = await gate({ ...(await sign(eve, {})), text: "x" });
    expect(v.verdict === "reject" && v.reason).toBe("bad_signature");
  });

  test("replay memory is per sender: Eve cannot burn Alice's msg_id", async () => {
    const replay = new ReplayMemory();
    replay.remember(eve.publicKey, "m1", NOW, NOW);
    expect((await gate(await sign(alice, { msg_id: "m1" }), replay)).verdict).toBe("deliver");
  });

  test("replay memory forgets what freshness already rejects, and is capped", () => {
    const r = new ReplayMemory(3);
    r.remember("a", "old", NOW - FRESH_PAST_MS - 1, NOW);
    expect(r.has("a", "old")).toBe(false);
    for (const id of ["1", "2", "3", "4"]) r.remember("a", id, NOW, NOW);
    expect(r.size).toBe(3);
    expect(r.has("a", "1")).toBe(false);
    expect(r.evicted).toBe(1);
    expect(r.has("a", "4")).toBe(true);
  });
});

// ----------------------------------------------------------------------------
describe("task folding and lifecycle", () => {
  const NOW = 1_767_225_600_000;
  const msg = async (from: Identity, to: Identity, f: Partial<SignedMessage>) =>
    signMessage(from, { to: to.publicKey, text: "x", ...f } as never, NOW);

  test("request → update → needs_input → answer → result folds to a closed task, blocked in between", async () => {
    const tasks = new Map<string, TaskRow>();
    foldTask(tasks, "out", await msg(alice, bob, { task_id: "t" }), 1);
    foldTask(tasks, "in", await msg(bob, alice, { task_id: "t", status: "update" }), 2);
    const q = await msg(bob, alice, { task_id: "t", status: "needs_input", msg_id: "q1" });
    foldTask(tasks, "in", q, 3);
    const row = [...tasks.values()][0];
    expect(row.requested_by).toBe("me");
    expect(row.awaiting).toEqual([{ msg_id: "q1", asked_by: "peer" }]);
    foldTask(tasks, "out", await msg(alice, bob, { task_id: "t", in_reply_to: "q1" }), 4);
    expect(row.awaiting).toEqual([]);
    expect(row.closed).toBe(false);
    foldTask(tasks, "in", await msg(bob, alice, { task_id: "t", status: "result" }), 5);
    expect(row.closed).toBe(true);
    expect(row.status).toBe("result");
    expect(row.messages).toBe(5);
  });

  test("a question is answered only from the other side", async () => {
    const tasks = new Map<string, TaskRow>();
    foldTask(tasks, "in", await msg(bob, alice, { task_id: "t", status: "needs_input", msg_id: "q" }), 1);
    foldTask(tasks, "in", await msg(bob, alice, { task_id: "t", in_reply_to: "q" }), 2);
    expect([...tasks.values()][0].awaiting.length).toBe(1);
  });

  test("after a terminal status the task is closed for updates, questions and new terminals", async () => {
    const tasks = new Map<string, TaskRow>();
    foldTask(tasks, "out", await msg(alice, bob, { task_id: "t", status: "canceled" }), 1);
    for (const status of ["update", "needs_input", "result", undefined] as const) {
      expect(lifecycleError(tasks, { to: bob.publicKey, text: "x", task_id: "t", status })).toContain("new task_id");
    }
    foldTask(tasks, "in", await msg(bob, alice, { task_id: "t", status: "update" }), 2);
    expect([...tasks.values()][0].status).toBe("canceled");
    expect(lifecycleError(tasks, { to: bob.publicKey, text: "x", task_id: "t2", status: "update" })).toBeNull();
    expect(lifecycleError(tasks, { to: bob.publicKey, text: "x", status: "update" })).toContain("needs a task_id");
  });

  test("the same task_id with two peers is two tasks", async () => {
    const tasks = new Map<string, TaskRow>();
    foldTask(tasks, "out", await msg(alice, bob, { task_id: "t", status: "result" }), 1);
    foldTask(tasks, "out", await msg(alice, eve, { task_id: "t" }), 2);
    expect(tasks.size).toBe(2);
    expect(lifecycleError(tasks, { to: eve.publicKey, text: "x", task_id: "t", status: "update" })).toBeNull();
  });
});

// ----------------------------------------------------------------------------
describe("JSONL storage", () => {
  test("a torn last line is skipped with a warning, and the next append starts a line of its own", () => {
    const dir = tmpDir();
    const file = path.join(dir, "log.jsonl");
    fs.writeFileSync(file, '{"t":"a","n":1}\n{"t":"a","n":2}\n{"t":"a","n":');
    const warnings: string[] = [];
    expect(readJsonl(file, (w) => warnings.push(w)).map((r) => r.n)).toEqual([1, 2]);
    expect(warnings.join()).toContain("torn");
    const w = new JsonlWriter(file);
    w.append([{ t: "a", n: 3 }]);
    w.close();
    expect(readJsonl(file, () => {}).map((r) => r.n)).toEqual([1, 2, 3]);
  });

  test("a garbage middle line is skipped without losing its neighbours", () => {
    const file = path.join(tmpDir(), "log.jsonl");
    fs.writeFileSync(file, '{"t":"a","n":1}\nthis is a hand edit\n[1,2]\n{"no":"tag"}\n{"t":"a","n":2}\n');
    const warnings: string[] = [];
    expect(readJsonl(file, (w) => warnings.push(w)).map((r) => r.n)).toEqual([1, 2]);
    expect(warnings.length).toBe(3);
  });

  test("scan resumes from an offset and leaves an unterminated tail for later", () => {
    const file = path.join(tmpDir(), "log.jsonl");
    fs.writeFileSync(file, '{"t":"a","n":1}\n{"t":"a"');
    const seen: unknown[] = [];
    const first = scanJsonl(file, 0, (r) => seen.push(r.n));
    expect(first).toEqual({ next: 16, tornBytes: 8 });
    fs.appendFileSync(file, ',"n":2}\n');
    const second = scanJsonl(file, first.next, (r) => seen.push(r.n));
    expect(seen).toEqual([1, 2]);
    expect(second.tornBytes).toBe(0);
  });

  test("lines longer than the 1 MiB read chunk survive intact", () => {
    const file = path.join(tmpDir(), "log.jsonl");
    const big = "x".repeat(3 << 20);
    fs.writeFileSync(file, JSON.stringify({ t: "a", big }) + "\n" + '{"t":"b"}\n');
    const records = readJsonl(file);
    expect(records.length).toBe(2);
    expect((records[0].big as string).length).toBe(big.length);
  });

  test("compaction replaces the file through a temp file and appends continue after it", async () => {
    const dir = tmpDir();
    const file = path.join(dir, "q.jsonl");
    const w = new JsonlWriter(file);
    await w.appendDurable(Array.from({ length: 100 }, (_, n) => ({ t: "m", n })));
    w.compact([{ t: "m", n: 99 }]);
    await w.appendDurable([{ t: "m", n: 100 }]);
    w.close();
    expect(readJsonl(file).map((r) => r.n)).toEqual([99, 100]);
    expect(fs.readdirSync(dir)).toEqual(["q.jsonl"]);
    expect(fs.statSync(file).mode & 0o777).toBe(0o600);
  });

  test("group commit: concurrent durable appends all resolve and all land, in order", async () => {
    const file = path.join(tmpDir(), "q.jsonl");
    const w = new JsonlWriter(file);
    await Promise.all(Array.from({ length: 200 }, (_, n) => w.appendDurable([{ t: "m", n }])));
    w.close();
    expect(readJsonl(file).map((r) => r.n)).toEqual(Array.from({ length: 200 }, (_, n) => n));
  });

  test("a second process cannot take a lock that a live process holds", async () => {
    const dir = tmpDir();
    const lockFile = path.join(dir, "store.lock");
    const holder = Bun.spawn([process.execPath, "-e", `
      const { PidLock } = await import(${JSON.stringify(SCRIPT)});
      await PidLock.acquire(${JSON.stringify(lockFile)}, "test holder");
      console.log("held");
      await new Promise(() => {});
    `], { stdout: "pipe" });
    const reader = holder.stdout.getReader();
    expect(new TextDecoder().decode((await reader.read()).value)).toContain("held");
    try {
      const err = await PidLock.acquire(lockFile, "second").catch((e) => e);
      expect(err).toBeInstanceOf(LockedError);
      expect(String(err.message)).toContain(`pid ${holder.pid}`);
    } finally {
      holder.kill("SIGKILL");
      await holder.exited;
    }
    // The holder died without releasing: its lock is now stale and is taken over.
    const lock = await PidLock.acquire(lockFile, "after the crash");
    expect(JSON.parse(fs.readFileSync(lockFile, "utf8")).pid).toBe(process.pid);
    lock.release();
    expect(fs.existsSync(lockFile)).toBe(false);
  });

  test("a stale lock left by a dead pid is taken over", async () => {
    const lockFile = path.join(tmpDir(), "store.lock");
    const dead = Bun.spawnSync(["true"]).pid;
    fs.writeFileSync(lockFile, JSON.stringify({ pid: dead, role: "crashed", since: 0 }));
    const lock = await PidLock.acquire(lockFile, "new owner");
    expect(JSON.parse(fs.readFileSync(lockFile, "utf8")).role).toBe("new owner");
    lock.release();
  });
});

// ----------------------------------------------------------------------------
describe("identity files and the allowlist", () => {
  test("keygen writes a 0600 key, refuses to overwrite it, and --force replaces it", () => {
    const key = path.join(tmpDir(), "sub", "id.key");
    const first = runCli("bun", ["keygen", "--out", key]);
    expect(first.code).toBe(0);
    expect(fs.statSync(key).mode & 0o777).toBe(0o600);
    const publicKey = first.stdout.match(/public key\s+(\S+)/)![1];
    const snippet = JSON.parse(first.stdout.slice(first.stdout.indexOf("{")));
    expect(parsePeers(JSON.stringify(snippet)).byKey.has(publicKey)).toBe(true);
    const again = runCli("bun", ["keygen", "--out", key]);
    expect(again.code).toBe(1);
    expect(again.stderr).toContain("refusing to overwrite");
    expect(runCli("bun", ["id", "--key", key]).stdout).toContain(publicKey);
    const forced = runCli("bun", ["keygen", "--out", key, "--force"]);
    expect(forced.code).toBe(0);
    expect(forced.stdout).not.toContain(publicKey);
    expect(fs.statSync(key).mode & 0o777).toBe(0o600);
  });

  test("INTERLINK_KEY is the env twin of --key, and a missing key names the file and the fix", () => {
    const key = path.join(tmpDir(), "none.key");
    const r = runCli("bun", ["id"], { env: { INTERLINK_KEY: key } });
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(key);
    expect(r.stderr).toContain("interlink.ts keygen");
  });

  test("peers.json errors name the petname and the problem", () => {
    expect(() => parsePeers("{")).toThrow("not JSON");
    expect(() => parsePeers(JSON.stringify({ bob: { key: "short" } }))).toThrow("'bob': key is not 32 bytes");
    expect(() => parsePeers(JSON.stringify({ bob: "x" }))).toThrow("'bob'");
    expect(() => parsePeers(JSON.stringify({ a: { key: ALICE.public_b64 }, b: { key: ALICE.public_b64 } }))).toThrow("same key as 'a'");
    expect(() => parsePeers(JSON.stringify({ weak: { key: "AQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA" } }))).toThrow("small-order");
    expect(() => parsePeers(JSON.stringify({ "bad name!": { key: ALICE.public_b64 } }))).toThrow("petname");
    const ok = parsePeers(JSON.stringify({ alice: { key: ALICE.public_b64, note: "unknown fields are ignored" } }));
    expect(ok.byName.get("alice")).toBe(ALICE.public_b64);
  });

  test("add refuses to rekey a petname or to give a key a second petname; saves are atomic and 0600", async () => {
    const file = path.join(tmpDir(), "peers.json");
    fs.writeFileSync(file, JSON.stringify({ alice: { key: ALICE.public_b64, note: "kept" } }));
    expect(await addPeer(file, "bob", BOB.public_b64)).toBe("added");
    expect(await addPeer(file, "bob", BOB.public_b64)).toBe("unchanged");
    await expect(addPeer(file, "bob", EVE.public_b64)).rejects.toThrow("refusing to rekey");
    await expect(addPeer(file, "bobby", BOB.public_b64)).rejects.toThrow("already in peers.json as 'bob'");
    expect(fs.statSync(file).mode & 0o777).toBe(0o600);
    const raw = JSON.parse(fs.readFileSync(file, "utf8"));
    expect(raw.alice.note).toBe("kept");
    expect(await removePeer(file, "bob")).toBe(BOB.public_b64);
    await expect(removePeer(file, "bob")).rejects.toThrow("no peer named 'bob'");
    expect(fs.readdirSync(path.dirname(file))).toEqual(["peers.json"]);
  });
});

afterAll(() => {});
