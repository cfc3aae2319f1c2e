/**
 * extras/upgrade.ts: `interlink.ts upgrade`, run once on a state folder that interlink.ts 0.4.0 wrote; until it has
 * run, the node opens no session there (see isOldShape and upgradeNeeded in interlink.ts). It moves a 0.4.0 journal
 * from the state folder into a session folder of its own, turns an inbox.cursor into "shown" records (the messages
 * before it were read), and rewrites records of 0.4.0's shapes into today's. Nothing is lost: the journal's unsent
 * outbox, its tasks and its unread messages fold as they did. Every step can be cut short by a crash and run again:
 * files move by rename, what the cursor says is journaled before the cursor goes, and each journal is replaced whole.
 * It holds a session's agent.lock while it changes that session, so no session of it runs meanwhile.
 *
 * Below it, apart, the relay's one-time upgrade: a bus started on a data folder holding the queue.jsonl of the JSONL bus
 * before it takes that in (importJsonl); bus.ts loads this file only then.
 */

import { Buffer } from "node:buffer";
import * as fs from "node:fs";
import * as path from "node:path";
import type { DatabaseSync } from "node:sqlite";
import {
  type CommandSpec,
  decodeRecord,
  defaultNodeState,
  EXTRAS,
  failpoint,
  fileSize,
  InterlinkError,
  isObject,
  isOldShape,
  journalFiles,
  type JournalRecord,
  JsonlWriter,
  messageKey,
  NodeState,
  OPT,
  option,
  type Options,
  parseRoute,
  PidLock,
  print,
  readIdentity,
  runExtra,
  scanJsonl,
  scanLines,
  SESSION_RE,
  sessionDir,
  sessionIds,
  setAside,
  utf8Bytes,
  writeFileAtomic,
} from "../interlink.ts";

/** The session a 0.4.0 journal becomes, unless --session names another: the node's next session adopts it. */
const UPGRADED_SESSION = "0.4.0-journal";

/**
 * interlink.ts 0.4.0's shapes (see isOldShape), turned into today's:
 *   "in" with `"pushed": true` (shown by push)  → "in", then "shown" {item, via: "push"}
 *   "in" without "peer"                       → peer "?"
 *   "shown" {from, msg_id}                      → "shown" {item: "<from> <msg_id>"}
 *   "knock" {name, msg} (the whole message)     → "knock" {key, name, msg_id, ts} (its text never kept)
 *   "out" without "recipient"                   → recipient: the message's `to`
 */
export function upgradeRecord(o: Record<string, unknown>): Record<string, unknown>[] {
  const msg = isObject(o.msg) ? o.msg : undefined;
  switch (o.t) {
    case "in": {
      const r: Record<string, unknown> = { ...o, peer: typeof o.peer === "string" ? o.peer : "?" };
      if (o.pushed !== true || !msg) return [r];
      delete r.pushed;
      return [r, { t: "shown", at: o.at, item: messageKey(String(msg.from), String(msg.msg_id)), via: "push" }];
    }
    case "shown":
      return o.item === undefined && typeof o.from === "string" && typeof o.msg_id === "string"
        ? [{ t: "shown", at: o.at, item: messageKey(o.from, o.msg_id), via: o.via === "push" ? "push" : "inbox" }]
        : [o];
    case "knock":
      return o.key === undefined && msg
        ? [{ t: "knock", at: o.at, key: msg.from, name: msg.text, msg_id: msg.msg_id, ts: msg.ts }]
        : [o];
    case "out":
      return o.recipient === undefined && msg ? [{ ...o, recipient: msg.to }] : [o];
    default:
      return [o];
  }
}

/** Moves a 0.4.0 journal and its side files from the state folder into `dir`; what it moved. */
function moveJournal(stateDir: string, dir: string): string[] {
  const moved: string[] = [];
  for (const f of ["log.jsonl", "log.jsonl.corrupt", "inbox.cursor"]) {
    const from = path.join(stateDir, f), to = path.join(dir, f);
    if (!fs.existsSync(from)) continue;
    if (fs.existsSync(to)) {
      throw new InterlinkError(`${to} exists already: pass --session with a new id, for ${from} to move into`);
    }
    fs.renameSync(from, to);
    moved.push(f);
  }
  return moved;
}

/**
 * A session's inbox.cursor (0.4.0: the byte offset in log.jsonl up to which the inbox was read), said in the journal as
 * a "shown" record for each message before it still unread, then removed; what it did. Journaled before the cursor
 * goes: run again after a crash, it finds those messages shown and adds nothing.
 */
async function applyCursor(dir: string, now: () => number): Promise<string | null> {
  const cursor = path.join(dir, "inbox.cursor"), journal = path.join(dir, "log.jsonl");
  if (!fs.existsSync(cursor)) return null;
  let offset = -1;
  try {
    const raw = JSON.parse(fs.readFileSync(cursor, "utf8"));
    if (isObject(raw) && Number.isSafeInteger(raw.offset)) offset = raw.offset as number;
  } catch {
    // unreadable: as one that does not fit
  }
  const fits = offset >= 0 && offset <= fileSize(journal);
  const state = new NodeState(now);
  const before: string[] = []; // messages whose line ends at or before the cursor
  scanJsonl(journal, 0, (raw, _at, end) => {
    for (const o of upgradeRecord(raw)) {
      let records: JournalRecord[];
      try {
        records = decodeRecord(o);
      } catch {
        continue; // not a record: the session sets it aside when it opens, as any other
      }
      for (const r of records) {
        state.apply(r);
        if (r.t === "in" && end <= offset) before.push(messageKey(r.msg.from, r.msg.msg_id));
      }
    }
  });
  const read = fits ? before.filter((item) => state.inbox.has(item)) : [];
  if (read.length) {
    const writer = new JsonlWriter(journal);
    try {
      await writer.appendDurable(read.map((item) => ({ t: "shown", at: now(), item, via: "inbox" })));
    } finally {
      writer.close();
    }
  }
  fs.rmSync(cursor);
  return fits
    ? `${cursor}: ${read.length} message(s) before it marked read`
    : `${cursor} does not fit ${journal}: every unread message stays unread`;
}

/**
 * A journal file with its records of 0.4.0's shapes rewritten, every other line byte for byte (a torn last line too,
 * which the session skips as ever); null if it holds none.
 */
function upgradedJournal(file: string): { bytes: Buffer; records: number } | null {
  const parts: Buffer[] = [];
  let records = 0;
  const { next } = scanLines(file, 0, (buf, start, end) => {
    let o: unknown;
    try {
      o = JSON.parse(buf.toString("utf8", start, end));
    } catch {
      o = undefined;
    }
    if (isObject(o) && isOldShape(o)) {
      records++;
      parts.push(Buffer.from(upgradeRecord(o).map((r) => JSON.stringify(r) + "\n").join("")));
    } else parts.push(Buffer.from(buf.subarray(start, end)), Buffer.from("\n"));
  });
  if (!records) return null;
  parts.push(fs.readFileSync(file).subarray(next));
  return { bytes: Buffer.concat(parts), records };
}

/** Runs `step` holding `dir`'s agent.lock: a session that runs there is named, and nothing is changed. */
async function holdingSession<T>(dir: string, step: () => Promise<T>): Promise<T> {
  fs.mkdirSync(dir, { recursive: true, mode: 0o700 });
  const lock = await PidLock.acquire(path.join(dir, "agent.lock"), "interlink upgrade");
  try {
    return await step();
  } finally {
    lock.release();
  }
}

/**
 * Upgrades what interlink.ts 0.4.0 left in `stateDir`: its journal becomes `session`'s, then every session's cursor and
 * records of 0.4.0's shapes are carried over (see above); the lines of what it did, none if there was nothing to do.
 */
export async function upgradeStateFolder(
  stateDir: string,
  session = UPGRADED_SESSION,
  now: () => number = Date.now,
): Promise<string[]> {
  const done: string[] = [];
  if (["log.jsonl", "inbox.cursor"].some((f) => fs.existsSync(path.join(stateDir, f)))) {
    const dir = sessionDir(stateDir, session);
    const moved = await holdingSession(dir, () => Promise.resolve(moveJournal(stateDir, dir)));
    done.push(`moved ${moved.join(", ")} of interlink.ts 0.4.0 from ${stateDir} into session ${session} (${dir})`);
  }
  for (const id of sessionIds(stateDir)) {
    const dir = sessionDir(stateDir, id);
    const needs = fs.existsSync(path.join(dir, "inbox.cursor")) || journalFiles(dir).some((f) => upgradedJournal(f));
    if (!needs) continue;
    await holdingSession(dir, async () => {
      const cursor = await applyCursor(dir, now);
      if (cursor) done.push(cursor);
      for (const file of journalFiles(dir)) {
        const upgraded = upgradedJournal(file);
        if (!upgraded) continue;
        writeFileAtomic(file, upgraded.bytes);
        done.push(`${file}: ${upgraded.records} record(s) of interlink.ts 0.4.0 rewritten`);
      }
    });
  }
  return done;
}

async function runUpgrade(o: Options): Promise<number> {
  const stateDir = (o.state as string | undefined) ??
    defaultNodeState((await readIdentity(o.key as string)).fingerprint);
  const session = (o.session as string | undefined) ?? UPGRADED_SESSION;
  if (!SESSION_RE.test(session)) {
    throw new InterlinkError(`session id '${session}' must be 1-128 letters, digits, . _ -`);
  }
  const done = await upgradeStateFolder(stateDir, session);
  for (const line of done) print(line);
  print(
    done.length
      ? `upgraded ${stateDir}: its sessions open again, and carry on what it held`
      : `nothing of interlink.ts 0.4.0 in ${stateDir}: nothing to upgrade`,
  );
  return 0;
}

export const command: CommandSpec = {
  summary: EXTRAS["upgrade"].summary,
  about:
    "Run once on a state folder that interlink.ts 0.4.0 wrote: the node opens no session there until it has run.\n" +
    "It moves the 0.4.0 journal into a session folder of its own (--session), turns inbox.cursor into records of the\n" +
    "messages read, and rewrites records of 0.4.0's shapes. Nothing is lost, and running it again does no harm. The\n" +
    "moved journal is a session that has ended: the node's next session adopts its outbox and unread messages.",
  options: {
    key: OPT.key,
    state: OPT.state,
    session: option(
      "ID",
      undefined,
      UPGRADED_SESSION,
      "the session the 0.4.0 journal becomes (letters, digits, . _ -)",
    ),
  },
  run: runUpgrade,
};

// ============================================================================
// The relay's upgrade: an earlier bus's queue.jsonl into queue.db
// ============================================================================

/**
 * What the import shares with the bus's queue, handed over by bus.ts when it loads this file (an import of bus.ts here
 * would load the relay, and node:sqlite, into every `upgrade` of a node's state).
 */
type QueueRules = {
  claimedSigner(payload: string): { from: string; sig?: string; ts?: number };
  expiryOf(ts: number, signed?: number): number | null;
  MESSAGE_STAY_MS: number;
  RECIPIENT_MAX_CHARS: number;
};

/** Why a record of the JSONL bus's queue.jsonl is not one it wrote (the line is then set aside), or "". */
function badBusRecord(r: Record<string, unknown>, routeMax: number): string {
  const seq = (v: unknown) => Number.isSafeInteger(v) && (v as number) > 0;
  const route = typeof r.q === "string" && r.q !== "" && r.q.length <= routeMax;
  const valid = r.t === "m"
    ? route && seq(r.n) && typeof r.p === "string" && Number.isSafeInteger(r.ts)
    : r.t === "a" || r.t === "d"
    ? route && seq(r.n)
    : r.t === "o"
    ? route
    : r.t === "c"
    ? Number.isSafeInteger(r.ts)
    : r.t === "h" && seq(r.next);
  return valid ? "" : `not a valid "${String(r.t).slice(0, 8)}" record`;
}

/**
 * Takes in the queue.jsonl of the JSONL bus before this one (its records: fixtures/bus-0.5): every un-acked message
 * with its seq, ts, sender and size (so ack keys clients hold still work), every owner and the closed state, in one
 * transaction whose last row names the file (device, inode, size). The file is renamed aside, queue.jsonl.imported,
 * only once that committed, so a bus killed at any point takes it in once. An acked message ("a", in place or
 * appended; "d") is not taken in, and its seq is never given again. A line that is not a record, and a torn last
 * line, are set aside in queue.jsonl.corrupt, as that bus did, and never stop the import. Returns how many.
 */
export function importJsonl(db: DatabaseSync, file: string, log: (msg: string) => void, queue: QueueRules): number {
  const { claimedSigner, expiryOf, MESSAGE_STAY_MS, RECIPIENT_MAX_CHARS } = queue;
  if (!fs.existsSync(file)) return 0;
  const st = fs.statSync(file);
  const id = `${st.dev}:${st.ino}:${st.size}`, sql = (text: string) => db.prepare(text);
  let skipped = 0, top = 0; // top: the highest seq the file names
  if (sql("SELECT value FROM meta WHERE name = 'imported'").get()?.value !== id) {
    const insert = sql("INSERT OR IGNORE INTO message VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)"); // see QUEUE_SCHEMA_3
    const remove = sql("DELETE FROM message WHERE seq = ? AND route = ?");
    const owner = sql("INSERT OR IGNORE INTO owner (key) VALUES (?)");
    const closed = sql("INSERT INTO meta VALUES ('closed', ?1) ON CONFLICT DO UPDATE SET value = min(value, ?1)");
    const bad = (at: number, why: string, line: string) => void (setAside(file, at, why, line), skipped++);
    db.exec("BEGIN IMMEDIATE");
    try {
      const { next, tornBytes } = scanJsonl(file, 0, (record, at) => {
        const r = record as Record<string, unknown>, why = badBusRecord(r, RECIPIENT_MAX_CHARS);
        if (why) return bad(at, why, JSON.stringify(r));
        top = Math.max(top, r.t === "h" ? (r.next as number) - 1 : (r.n as number | undefined) ?? 0);
        if (r.t === "m") {
          const p = r.p as string, c = claimedSigner(p), sender = typeof r.s === "string" ? r.s : c.from; // < 0.5: none
          const sig = sender === c.from ? c.sig ?? null : null; // the signature of the signer it is counted against
          const ts = r.ts as number, expires = sender ? expiryOf(ts, c.ts) : Date.now() + MESSAGE_STAY_MS;
          const taken = insert.run(r.n as number, r.q as string, ts, sender, utf8Bytes(p), p, sig, expires).changes;
          if (!taken) bad(at, `seq ${r.n} is in the queue database already`, JSON.stringify(r));
        } else if (r.t === "a" || r.t === "d") remove.run(r.n as number, r.q as string);
        else if (r.t === "o") owner.run(parseRoute(r.q as string).key); // an older bus wrote one per route
        else if (r.t === "c") closed.run(r.ts as number);
      }, bad);
      if (tornBytes) {
        const tail = Buffer.alloc(tornBytes), fd = fs.openSync(file, "r");
        fs.readSync(fd, tail, 0, tornBytes, next);
        fs.closeSync(fd);
        bad(next, "torn last line", tail.toString());
      }
      if (!sql("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'message'").run(top).changes) {
        sql("INSERT INTO sqlite_sequence (name, seq) VALUES ('message', ?)").run(top);
      }
      sql("INSERT OR REPLACE INTO meta VALUES ('imported', ?)").run(id);
      failpoint("bus-mid-import"); // everything written, not yet committed
      db.exec("COMMIT");
    } catch (e) {
      if (db.isTransaction) db.exec("ROLLBACK");
      throw e;
    }
  }
  failpoint("bus-after-import"); // committed, the file not yet renamed aside
  fs.renameSync(file, `${file}.imported`);
  const corrupt = `${skipped} lines set aside in .corrupt`;
  log(`took in ${file}, the queue of an earlier bus (${corrupt}); kept as ${file}.imported`);
  return skipped;
}

if (import.meta.main) runExtra("upgrade", command);
