#!/usr/bin/env bun
/**
 * bus.ts: the relay. `interlink.ts bus` (or `bun bus.ts`) runs it: the durable keep-until-ack HTTP bus that nodes
 * talk through (SPEC "Bus HTTP API"). It is the one part of interlink that strangers reach, and it trusts none of
 * them: it holds no keys, verifies what it can (a v2 message's signature, an announcement's, an ownership proof) and
 * decides nothing for a node: the receiver's gate alone admits a message.
 *
 * What it defends: a 202 is never lost (committed to its SQLite queue, WAL fsynced, before it is answered), nor an
 * ack undone; a key that proved it reads its routes here is the only one to read or ack them; no sender, address or
 * stranger takes more than its share of the queue, the roster, the disk, the bytes in flight or the connections.
 * What it does not defend: confidentiality (it reads every payload it relays) and availability against its own
 * operator (it can drop or delay; it cannot forge). It imports the node (interlink.ts) for the wire; never the reverse.
 *
 * Sections, in dependency order (each uses only what stands above it):
 *   Constants · Queue and roster logic · Requests and answers · The queue database · The bus · Serving HTTP · CLI
 */

import { Buffer } from "node:buffer";
import { spawnSync } from "node:child_process";
import { createPublicKey, type KeyObject, verify } from "node:crypto";
import * as fs from "node:fs";
import type * as net from "node:net";
import * as path from "node:path";
import { DatabaseSync } from "node:sqlite";
import {
  type Announcement,
  ANNOUNCEMENT_MAX_BYTES,
  ANNOUNCEMENT_VALUES_MAX,
  BODY_LIMIT_BYTES,
  BoundedMap,
  BUS_EXPOSURE,
  busDataDir,
  type CommandSpec,
  DEFAULT_BUS_PORT,
  field,
  fingerprint,
  FormatError,
  FRESH_FUTURE_MS,
  HELD_MAX_MS,
  humanBytes,
  InterlinkError,
  intOption,
  isLoopback,
  isObject,
  JSON_VALUES_MAX,
  jsonShape,
  logInfo,
  logWarn,
  msFromEnv,
  option,
  type Options,
  parseAnnouncement,
  parseRoute,
  parseSignedMessage,
  PidLock,
  PRESENCE_LIVE_MS,
  QUEUE_CAP,
  RECV_TIMEOUT_MS,
  recvProofBytes,
  ROSTER_CAP,
  ROSTER_PER_KEY_CAP,
  ROSTER_RETENTION_MS,
  rosterKey,
  ROUTE_FULL,
  runExtra,
  runtimeHost,
  setAside,
  setLogComponent,
  shutdownSignal,
  type SignedMessage,
  syncDirectory,
  timestamp,
  unregisterBytes,
  useEd25519,
  utf8Bytes,
  verifyAnnouncement,
  verifyDetached,
  verifyMessage,
  VERSION,
  writeFileAtomic,
} from "./interlink.ts";

// ============================================================================
// Constants
// ============================================================================

/** Longest wait a client may ask for; past it proxies and NATs start cutting idle connections. */
const RECV_TIMEOUT_MAX_MS = 60_000;
/** Payloads not from a verified signer (not v2) per recipient key, all its routes (they are free): 429 past it. */
const OPAQUE_CAP = 64;
/** Payload bytes one signer may have queued on a bus, all recipients together: one sender cannot fill it. */
const SENDER_BYTES_MAX = 8 << 20;
/** Bytes a bus holds in all (507 past it): full of 900 KB floods a Bun bus peaks near 4× this in memory, Deno 4.3×. */
const TOTAL_BYTES_MAX = 32 << 20;
/** ... of which mail for keys that never proved a route here, which nobody may ever read: the rest is for owners'. */
const UNCLAIMED_SHARE = 1 / 2;
/** ... and from one source address (429), a quarter: keys are free, an address is not; one leaves the owners room. */
const ADDRESS_SHARE = 1 / 4;
/** All of loopback as one source address (see addressBucket): this machine's processes, held to no ADDRESS_SHARE. */
const LOOPBACK = "127.0.0.0/8";
/** A request's source when the runtime gives none (its connection reset first): refused, its client is gone anyway. */
const NO_ADDRESS = "?";
/** A sessionless (0.4) announcement is served this long, as a 0.4 bus does: 0.4 clients read every entry as live. */
const ROSTER_SESSIONLESS_MS = 90_000;
/** Roster units per source address (see addressBucket): a machine's hundreds of sessions, a quarter of the roster. */
const ROSTER_PER_ADDRESS_CAP = 1024;
/** Against the bounds above, an entry counts one per this many bytes begun (a real one counts one): roster ≤ 4 MiB. */
const ROSTER_UNIT_BYTES = 1024;
// Sessions remembered as ended by a signed unregister, so nobody re-posts their last announcement: more than end in
// ROSTER_RETENTION_MS on a real bus, a few MB. Past it the address that ended the most forgets its oldest.
const ROSTER_ENDED_CAP = 8192;
/** ... and ended from one source address: past it that address's own oldest is forgotten, nobody else's. */
const ROSTER_ENDED_PER_ADDRESS_CAP = 512;
/** Body bytes read at once, in all (503 past it, unread): sixteen of the largest; stalled uploads cost no more. */
const BODIES_IN_FLIGHT_MAX = 32 << 20;
/** ... and from one source address (429): four of the largest at once; one host cannot take the whole budget. */
const BODIES_IN_FLIGHT_PER_ADDRESS = 8 << 20;
/** A body declared this small counts apart: one local process holding 127/8's share of large ones stops no small. */
const SMALL_BODY_BYTES = 16 << 10;
/** ... against an allowance of its own per address (429): 128 stalled ones, not the bus's budget (2,100 took it). */
const SMALL_BODIES_PER_ADDRESS = 2 << 20;
/** Answers this large are streamed and counted in flight; a smaller one the socket's buffers take at once, whole. */
const ANSWER_STREAM_MIN_BYTES = 64 << 10;
/** Bytes of large answers not yet taken by their connections, in all (503 past it): sixteen of the largest message. */
const ANSWERS_IN_FLIGHT_MAX = 32 << 20;
/** ... and for one source address (429): four of the largest at once; one host cannot take the whole budget. */
const ANSWERS_IN_FLIGHT_PER_ADDRESS = 8 << 20;
/** Payload one batched recv answers (one message at least): half an address's answers, so a session's two fit. */
const RECV_BATCH_BYTES = 4 << 20;
/** Messages one batched recv answers at most (our extension: GET /recv?max=N), and acks one POST /ack takes. */
const RECV_BATCH_MAX = 64;
/** A message's stay at most (Bus.expire): no node of ours takes a signed one later, its clock a minute behind too. */
const MESSAGE_STAY_MS = HELD_MAX_MS + FRESH_FUTURE_MS;
/** Longest recipient string the bus accepts: a 43-char key plus a label. */
const RECIPIENT_MAX_CHARS = 512;
// Room a bus leaves free on its disk (a sixteenth of a smaller disk): sends past it are refused (507), so acks, an
// owner's row and the "closed" row have room; queue.reserve keeps as much again for acks (Bus.#keepRoom).
const DISK_RESERVE_BYTES = 1 << 20;
// Pages the WAL holds before a checkpoint (2 fsyncs on the event loop) copies it into queue.db: mostly the same few
// pages written again, so fewer checkpoints cost less (128 took 20 % of a Bun bus's profile, 1,000 12.5 %).
const WAL_PAGES = 1000;
// fdatasyncs of the WAL at once (Bus.#flush): a write waits for its own, not for the one before to end first. 3 did
// 2,390 to 2,475 msg/s where 2 did 2,240 to 2,391 and one at a time 2,086 to 2,291 (bench.ts, alternating runs);
// each holds a thread of the runtime's and a descriptor while it runs.
const SYNCS_IN_FLIGHT = 3;
/** How long a bus trusts its last look at the disk's free space (statfs), less what it wrote since. */
const DISK_LOOK_MS = 100;
/** What one owner's row takes on disk at most (its key in the owner table's b-tree, the WAL frame it dirties). */
const OWNER_ROW_BYTES = 4096;
/** What a message costs beside its payload (counts in memory, row and index on disk): 32 MiB holds about 130,000. */
const MESSAGE_OVERHEAD_BYTES = 256;
/** ... and a route holding messages: its counts in memory (about 500 bytes with its name); 43,633 in 32 MiB. */
const ROUTE_OVERHEAD_BYTES = 512;
/** A body not all there this long after its headers is refused (408): a byte every few seconds holds nothing. */
const CONN_BODY_MS = msFromEnv("INTERLINK_TEST_CONN_BODY_MS", 15_000);
/** A large answer not all taken this long after it was made is cut off (4 MiB in 30 s: a 140 KB/s link at least). */
const ANSWER_WRITE_MS = msFromEnv("INTERLINK_TEST_ANSWER_WRITE_MS", 30_000);
/** A recv/ack proof is honoured this long either side of its ts (clients renew theirs every minute). */
const RECV_PROOF_FRESH_MS = 5 * 60_000;
// Keys whose routes a bus protects at most (`--owners`): far above any real deployment, about 6 MB of database and
// 10 MB of memory. Past it the bus closes (Bus.#close): forgetting an owner would let a flood of keys read mail.
const OWNERS_MAX = 100_000;
/** Routes whose last verified proof is remembered, so a client's repeats skip the signature check (a minute each). */
const PROOFS_REMEMBERED = 4096;
/** Deepest JSON nesting a request may have: a signed message nests 2 levels, an announcement 3. */
const JSON_DEPTH_MAX = 64;
/** An unregister is honoured only this long after it was signed (a captured one cannot be replayed later). */
const UNREGISTER_FRESH_MS = 5 * 60_000;
/** What this bus adds to the reference contract, named in an `interlink-bus` header on GET /roster (doctor reads it). */
const BUS_FEATURES = `${VERSION} ownership signed-unregister verified-roster batch-recv batch-send full-refused`;
/** A large answer's slice handed to the runtime at a time: what a slow reader keeps in the bus's memory. */
const ANSWER_CHUNK_BYTES = 64 << 10;
/** The server closes a connection idle this long between requests, or this slow to send its headers. */
const CONN_IDLE_MS = msFromEnv("INTERLINK_TEST_CONN_IDLE_MS", 10_000);
/** How long the server's self-check waits to see its own connection accepted (see serveHttp). */
const CONN_PROBE_MS = msFromEnv("INTERLINK_TEST_CONN_PROBE_MS", 3_000);
/** Connections the server holds at most (see connectionBound). */
const CONN_MAX = 10_000;
/** Newcomers past that bound told to come back (503) at once, each for a second at most; more are closed unanswered. */
const CONN_TURNED_AWAY_MAX = 32;
/** A request's line and headers past this are refused (431): ours send under 1 KiB; it bounds what a head holds. */
const HEAD_MAX_BYTES = 16 << 10;

// ============================================================================
// Queue and roster logic
// ============================================================================

/** What BusQueues lets in (full counts the caps, admit the bytes): the constants above, or a bus's own options. */
const QUEUE_LIMITS = {
  cap: QUEUE_CAP,
  opaqueCap: OPAQUE_CAP,
  senderBytes: SENDER_BYTES_MAX,
  totalBytes: TOTAL_BYTES_MAX,
  unclaimedShare: UNCLAIMED_SHARE,
  addressShare: ADDRESS_SHARE,
};
type QueueLimits = typeof QUEUE_LIMITS;

/** Adds `n` to `key`'s count in `counts`, forgetting the key at zero: each such map holds only what is counted. */
function addCount(counts: Map<string, number>, key: string, n: number): void {
  const sum = (counts.get(key) ?? 0) + n;
  if (sum > 0) counts.set(key, sum);
  else counts.delete(key);
}

/**
 * What the bus holds (the messages are in the queue database), counted to decide what is let in, no I/O. Nothing
 * accepted is ever dropped: a signer holding `cap` for a recipient is refused the next (`full`), so a flood costs
 * only its sender. An emptied route is forgotten: memory follows what is held, not what ever was.
 */
class BusQueues {
  #routes = new Map<string, Map<string, number>>(); // route → sender ("" unattributed) → messages: bounded by them
  #senders = new Map<string, { bytes: number; count: number }>(); // verified senders' holdings: bounded the same
  #keys = new Map<string, number>(); // recipient key → payloads and MESSAGE_OVERHEAD_BYTES each: bounded the same
  #opaque = new Map<string, number>(); // recipient key → unattributed messages: bounded the same
  #origins = new Map<string, number>(); // address bucket → payloads and MESSAGE_OVERHEAD_BYTES each: bounded the same
  liveCount = 0;
  bytes = 0;
  unclaimed = 0; // what #keys counts for keys not `owned`
  readonly limits: QueueLimits;

  /** `owned`: whether a recipient key proved a route here (Bus.isOwned); `ownerChanged` is told when that changes. */
  constructor(limits: Partial<QueueLimits> = {}, readonly owned: (key: string) => boolean = () => false) {
    this.limits = { ...QUEUE_LIMITS, ...limits };
  }

  /** `key` proved a route here, or its record failed: its mail moves out of the unclaimed share, or back. */
  ownerChanged(key: string): void {
    this.unclaimed += (this.owned(key) ? -1 : 1) * (this.#keys.get(key) ?? 0);
  }

  get recipientCount(): number {
    return this.#routes.size;
  }

  /** What the budget in all counts: payloads, MESSAGE_OVERHEAD_BYTES a message, ROUTE_OVERHEAD_BYTES a route. */
  get charged(): number {
    return this.bytes + this.liveCount * MESSAGE_OVERHEAD_BYTES + this.#routes.size * ROUTE_OVERHEAD_BYTES;
  }

  /** Why `size` bytes from `sender` to `to` ("": not known yet) from address bucket `origin` ("": none) can't go in. */
  admit(sender: string, size: number, to = "", origin = ""): "global" | "unclaimed" | "address" | "sender" | null {
    const { totalBytes, unclaimedShare, addressShare, senderBytes } = this.limits;
    const cost = size + MESSAGE_OVERHEAD_BYTES, route = this.#routes.has(to) ? 0 : ROUTE_OVERHEAD_BYTES;
    if (this.charged + cost + route > totalBytes) return "global";
    const unclaimed = to && !this.owned(parseRoute(to).key) ? this.unclaimed + cost : 0;
    if (unclaimed > totalBytes * unclaimedShare) return "unclaimed";
    if (origin && (this.#origins.get(origin) ?? 0) + cost > totalBytes * addressShare) return "address";
    const held = this.#senders.get(sender) ?? { bytes: 0, count: 0 }; // "": none held
    if (sender && held.bytes + held.count * MESSAGE_OVERHEAD_BYTES + cost > senderBytes) return "sender";
    return null;
  }

  /** How many `sender` holds for `to` (unattributed: for its key) once that reaches its cap, else null. */
  full(to: string, sender: string): number | null {
    const held = sender ? this.#routes.get(to)?.get(sender) ?? 0 : this.#opaque.get(parseRoute(to).key) ?? 0;
    return held >= (sender === "" ? this.limits.opaqueCap : this.limits.cap) ? held : null;
  }

  held(to: string): number {
    return [...this.#routes.get(to)?.values() ?? []].reduce((n, count) => n + count, 0);
  }

  /** Counts `count` messages of `size` bytes in all from `sender` to `to`, whatever the caps: `full` is asked first. */
  add(to: string, sender: string, size: number, count = 1, origin = ""): void {
    const route = this.#routes.get(to) ?? new Map<string, number>();
    const held = this.#senders.get(sender) ?? { bytes: 0, count: 0 };
    addCount(route, sender, count);
    if (route.size) this.#routes.set(to, route);
    else this.#routes.delete(to);
    if (sender && held.count + count > 0) {
      this.#senders.set(sender, { bytes: held.bytes + size, count: held.count + count });
    } else this.#senders.delete(sender);
    const { key } = parseRoute(to), n = size + count * MESSAGE_OVERHEAD_BYTES;
    addCount(this.#keys, key, n);
    if (origin) addCount(this.#origins, origin, n);
    if (!sender) addCount(this.#opaque, key, count);
    if (!this.owned(key)) this.unclaimed += n;
    this.liveCount += count;
    this.bytes += size;
  }

  /** What `add` counted, given back: an ack, or a send that could not be written. */
  remove(to: string, sender: string, size: number, origin = ""): void {
    if (this.#routes.get(to)?.get(sender)) this.add(to, sender, -size, -1, origin);
  }
}

/** `recipient NUL seq:ts`: a seq given again after a power cut took its first message (see Bus.send) names another. */
const ackKey = (me: string, m: { seq: number; ts: number }) => `${me}\0${m.seq}:${m.ts}`;

/** Which message of `me` an ack names: its seq, and its ts unless the key has none (an earlier bus gave such keys). */
type AckMark = { seq: number; ts?: number };

/** The seq and ts an ack key of `me` names, or undefined if it names none. */
function parseAckKey(me: string, key: string): AckMark | undefined {
  const m = /^(\d{1,16})(?::(-?\d{1,16}))?$/.exec(key.slice(me.length + 1)); // a ts is any safe integer on disk
  return m ? { seq: Number(m[1]), ...(m[2] === undefined ? {} : { ts: Number(m[2]) }) } : undefined;
}

/** At least the bytes of a GET /recv answer to `me` of `items`: per message its payload, ts, ack key and JSON around. */
function recvAnswerBytes(me: string, items: readonly { size: number }[]): number {
  const perMessage = utf8Bytes(JSON.stringify(me)) + 112;
  return items.reduce((n, m) => n + m.size + perMessage, 64);
}

interface RosterEntry {
  json: string; // the announcement as posted, without age_ms
  at: number; // when it was last refreshed here
  ts: number; // its signed time: an older one never replaces a newer one
  pubkey: string;
  sessionless: boolean;
  from: string; // the address bucket that last posted it (see addressBucket)
  units: number; // what it counts against the bounds: one per KiB begun (ROSTER_UNIT_BYTES)
}

/**
 * Presence on the bus: verified announcements keyed `pubkey#session_id` (the bare key when sessionless), kept
 * ROSTER_RETENTION_MS (sessionless: ROSTER_SESSIONLESS_MS), bounded in units (ROSTER_UNIT_BYTES) in all, per key and
 * per source address. Keys cost nothing, so a flood never pushes out a live session: past its key's bound, that key's
 * sessions signed before the newcomer go, earliest first; past the address's or the roster's, only entries away
 * PRESENCE_LIVE_MS or more, stalest first, else the newcomer is refused. A refresh keeps its place, past the roster's
 * bound too. An unregistered session is not listed again from an older announcement (see end). Kept in refresh order.
 */
class Roster {
  #entries = new Map<string, RosterEntry>(); // bounded: `cap` units, each entry at least one
  #perKey = new Map<string, number>(); // units: bounded by the entries
  #perAddress = new Map<string, number>(); // units per address bucket: bounded by the entries
  units = 0; // what the entries count in all
  /** Sessions ended by a signed unregister, with its ts and address bucket (see end). */
  #ended = new Map<string, { ts: number; from: string }>(); // bounded: endedCap, oldest first
  #endedBy = new Map<string, Set<string>>(); // each address bucket's ended ids, oldest first: bounded with #ended

  constructor(
    readonly cap = ROSTER_CAP,
    readonly perKeyCap = ROSTER_PER_KEY_CAP,
    readonly perAddressCap = ROSTER_PER_ADDRESS_CAP,
    readonly endedCap = ROSTER_ENDED_CAP,
    readonly endedPerAddressCap = ROSTER_ENDED_PER_ADDRESS_CAP,
  ) {}

  get size(): number {
    return this.#entries.size;
  }

  /** Files an announcement from address bucket `from`: true, or why not (newer one filed, session ended, a bound). */
  put(a: Announcement, json: string, nowMs: number, from = ""): true | "older" | "ended" | "full" | "address" | "key" {
    const id = rosterKey(a);
    if (a.ts <= (this.#ended.get(id)?.ts ?? -Infinity)) return "ended";
    const old = this.#entries.get(id);
    if (old && old.ts > a.ts) return "older";
    if (old && old.ts === a.ts) {
      // The same signed announcement again (a retry, a replay off GET /roster) only refreshes: padding beside the
      // signed members never changes what its key posted.
      this.#entries.delete(id);
      this.#entries.set(id, { ...old, at: nowMs });
      return true;
    }
    const units = Math.max(1, Math.ceil(utf8Bytes(json) / ROSTER_UNIT_BYTES));
    const going: string[] = []; // entries that give way
    const freed = { all: 0, key: 0, address: 0 }; // the units they free where this one counts
    const drop = (k: string, e: RosterEntry) => {
      going.push(k);
      freed.all += e.units;
      if (e.pubkey === a.pubkey) freed.key += e.units;
      if (e.from === from) freed.address += e.units;
    };
    if (old) drop(id, old);
    const over = {
      key: () => (this.#perKey.get(a.pubkey) ?? 0) - freed.key + units > this.perKeyCap,
      address: () => (this.#perAddress.get(from) ?? 0) - freed.address + units > this.perAddressCap,
      all: () => this.units - freed.all + units > this.cap,
    };
    /** Drops entries `which` allows, stalest first, until `bound` is met; false if it cannot be. */
    const makeRoom = (bound: () => boolean, which: (e: RosterEntry) => boolean): boolean => {
      for (const [k, e] of this.#entries) {
        if (!bound() || nowMs - e.at < PRESENCE_LIVE_MS) break; // refresh order: the rest are live too
        if (k !== id && which(e)) drop(k, e);
      }
      return !bound();
    };
    // By signed time, not refresh order: anyone can post a key's earlier announcements again, none sign a later one.
    if (over.key()) {
      const earlier = [...this.#entries].filter(([k, e]) => k !== id && e.pubkey === a.pubkey && e.ts <= a.ts);
      for (const [k, e] of earlier.sort(([, x], [, y]) => x.ts - y.ts)) if (over.key()) drop(k, e);
      if (over.key()) return "key";
    }
    if (!makeRoom(over.address, (e) => e.from === from)) return "address";
    if (!old && !makeRoom(over.all, () => true)) return "full";
    for (const k of going) this.#remove(k);
    const sessionless = !a.session?.session_id;
    this.#entries.set(id, { json, at: nowMs, ts: a.ts, pubkey: a.pubkey, sessionless, from, units });
    addCount(this.#perKey, a.pubkey, units);
    addCount(this.#perAddress, from, units);
    this.units += units;
    return true;
  }

  /** Removes `key` unless an announcement signed after `ts` is filed there. */
  remove(key: string, ts: number): void {
    const e = this.#entries.get(key);
    if (e && e.ts <= ts) this.#remove(key);
  }

  /**
   * Session `key` ended at signed time `ts` (its key's unregister, from address bucket `from`): removed unless a later
   * announcement is filed, and remembered until ROSTER_RETENTION_MS after `ts` (then announce refuses it as too old),
   * so a replay of its last announcement is refused ("ended"); bounded as ROSTER_ENDED_CAP says. A key longer than a
   * route (no mail can reach it) is not remembered.
   */
  end(key: string, ts: number, from: string, nowMs: number): void {
    this.remove(key, ts);
    if (key.length > RECIPIENT_MAX_CHARS) return;
    const old = this.#ended.get(key);
    if (old && old.ts >= ts) return;
    if (old) this.#forgetEnded(key);
    for (const [k, e] of this.#ended) { // oldest first, near enough: each ts is within minutes of when it came
      if (nowMs - e.ts < ROSTER_RETENTION_MS) break;
      this.#forgetEnded(k);
    }
    const mine = this.#endedBy.get(from);
    if (mine && mine.size >= this.endedPerAddressCap) this.#forgetEnded(mine.values().next().value!);
    else if (this.#ended.size >= this.endedCap) {
      const most = [...this.#endedBy.values()].reduce((x, y) => (y.size > x.size ? y : x));
      this.#forgetEnded(most.values().next().value!);
    }
    this.#ended.set(key, { ts, from });
    this.#endedBy.set(from, (this.#endedBy.get(from) ?? new Set()).add(key));
  }

  get endedCount(): number {
    return this.#ended.size;
  }

  #forgetEnded(key: string): void {
    const e = this.#ended.get(key)!;
    this.#ended.delete(key);
    const ids = this.#endedBy.get(e.from)!;
    ids.delete(key);
    if (!ids.size) this.#endedBy.delete(e.from);
  }

  #remove(key: string): void {
    const e = this.#entries.get(key)!;
    this.#entries.delete(key);
    this.units -= e.units;
    addCount(this.#perKey, e.pubkey, -e.units);
    addCount(this.#perAddress, e.from, -e.units);
  }

  /** At least the bytes of GET /roster's answer: each entry's units of ROSTER_UNIT_BYTES, plus its `age_ms`. */
  answerBytes(): number {
    return 16 + this.units * ROSTER_UNIT_BYTES + this.#entries.size * 32;
  }

  /** GET /roster's entries, each with an unsigned `age_ms`; expired ones are pruned. */
  list(nowMs: number): string[] {
    const out: string[] = [];
    for (const [key, e] of this.#entries) {
      const age = nowMs - e.at;
      if (age >= (e.sessionless ? ROSTER_SESSIONLESS_MS : ROSTER_RETENTION_MS)) this.#remove(key);
      else out.push(`${e.json.slice(0, -1)}${e.json.length > 2 ? "," : ""}"age_ms":${age}}`);
    }
    return out;
  }
}

// ============================================================================
// Requests and answers
// ============================================================================

class HttpError extends Error {
  /** `close`: the body was left unread (refused on its length, cut off), so the answer ends the connection. */
  constructor(readonly status: number, message: string, readonly close = false) {
    super(message);
  }
}

/**
 * The source a per-address budget counts against: an IPv4 address; the /64 of an IPv6 one (what one host usually
 * holds: else a host had 2^64 budgets); all of loopback, 127.0.0.0/8 and ::1, as one (LOOPBACK: any local user may
 * connect from all of it). "" for a request not over a socket. A bus behind a proxy sees every client as the proxy.
 */
function addressBucket(address: string): string {
  const v4 = /^(?:::ffff:)?(\d{1,3}(?:\.\d{1,3}){3})$/i.exec(address);
  if (v4) return v4[1].startsWith("127.") ? LOOPBACK : v4[1];
  if (address === "::1") return LOOPBACK;
  if (!address.includes(":")) return address;
  const [left, right] = address.split("%")[0].split("::");
  const head = left ? left.split(":") : [], tail = right ? right.split(":") : []; // "::" stands for the zeros between
  const groups = [...head, ...Array(Math.max(0, 8 - head.length - tail.length)).fill("0"), ...tail];
  return `${groups.slice(0, 4).map((g) => (parseInt(g, 16) || 0).toString(16)).join(":")}::/64`;
}

/**
 * Bytes in flight through the HTTP server, in all and per source address: request bodies being read (reserved before a
 * byte is read, or chunk by chunk, given back once the runtime lets go of them), or large answers being written
 * (reserved before their payloads are read, given back at the last byte, a close or the deadline). Past either budget a
 * request is refused: a thousand connections stalled on 2 MiB each hold the budget, not 2 GB.
 */
class BytesInFlight {
  bytes = 0;
  #byAddress = new Map<string, number>(); // bounded: an entry lives only while its address has bytes in flight
  #small = new Map<string, number>(); // the same, of small bodies (SMALL_BODY_BYTES): bounded the same

  /** `what`: the bytes counted, as refusals name them; `close`: a refusal ends the connection (a body left unread). */
  constructor(
    readonly max = BODIES_IN_FLIGHT_MAX,
    readonly perAddress = BODIES_IN_FLIGHT_PER_ADDRESS,
    readonly what = "request bodies being read",
    readonly close = true,
  ) {}

  /** Takes `n` bytes for address bucket `from` (`small`: of its allowance for small bodies), or throws a 429 or 503. */
  take(from: string, n: number, small = false): void {
    if (n <= 0) return;
    const [mine, most] = small ? [this.#small, SMALL_BODIES_PER_ADDRESS] : [this.#byAddress, this.perAddress];
    const held = mine.get(from) ?? 0;
    const refuse = (status: number, who: string, has: number, max: number, all = "") => {
      const what = `${small ? "small " : ""}${this.what}${all} (at most ${humanBytes(max)} at once)`;
      return new HttpError(status, `${who} already has ${humanBytes(has)} of ${what}; retry in a moment`, this.close);
    };
    if (held + n > most) throw refuse(429, "your address", held, most);
    if (this.bytes + n > this.max) throw refuse(503, "this bus", this.bytes, this.max, " in all");
    mine.set(from, held + n);
    this.bytes += n;
  }

  give(from: string, n: number, small = false): void {
    if (n <= 0) return;
    this.bytes -= n;
    addCount(small ? this.#small : this.#byAddress, from, -n);
  }
}

/** What one answer holds of the answers' BytesInFlight until `release` (idempotent); `writeMs`: see streamedAnswer. */
class AnswerHold {
  bytes = 0;
  constructor(readonly answers: BytesInFlight, readonly from: string, readonly writeMs = ANSWER_WRITE_MS) {}

  /** Holds `n` bytes in place of what it held, or throws the 429 or 503; nothing below ANSWER_STREAM_MIN_BYTES. */
  hold(n: number): void {
    this.release();
    if (n < ANSWER_STREAM_MIN_BYTES) return;
    this.answers.take(this.from, n);
    this.bytes = n;
  }

  release(): void {
    this.answers.give(this.from, this.bytes);
    this.bytes = 0;
  }
}

/** Answers made whole, with their text: the server writes that rather than read the Response (it streams the rest). */
const WHOLE_ANSWERS = new WeakMap<Response, string>(); // weak: gone with its answer

/** Every answer carries Date (the server adds none): `doctor` measures clock skew against it. */
function jsonResponse(status: number, body: BodyInit, headers: Record<string, string> = {}): Response {
  const headed = { "content-type": "application/json", date: new Date().toUTCString(), ...headers };
  const r = new Response(body, { status, headers: headed });
  if (typeof body === "string") WHOLE_ANSWERS.set(r, body);
  return r;
}

const errorResponse = (status: number, message: string, headers: Record<string, string> = {}): Response =>
  jsonResponse(status, JSON.stringify({ error: message }), headers);

/**
 * A JSON answer of `text`: whole when short; else a pull stream of slices, each made once the connection took the one
 * before (the server waits for the socket), its bytes counted in `held` until the last
 * slice, a close (cancel), or ANSWER_WRITE_MS after it was made (the stream fails, the connection closes): a reader
 * that never reads holds its share that long, never memory for good.
 */
function streamedAnswer(status: number, text: string, held: AnswerHold): Response {
  if (!held.bytes && Buffer.byteLength(text) < ANSWER_STREAM_MIN_BYTES) return jsonResponse(status, text);
  const bytes = Buffer.from(text);
  let at = 0, timer: ReturnType<typeof setTimeout> | undefined;
  const done = () => (clearTimeout(timer), held.release());
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      timer = setTimeout(() => {
        done();
        c.error(new Error(`the answer was not all read ${held.writeMs / 1000} s after it was made`));
      }, held.writeMs);
    },
    pull(c) {
      c.enqueue(bytes.subarray(at, at += ANSWER_CHUNK_BYTES));
      if (at >= bytes.length) (c.close(), done());
    },
    cancel: done,
  }, { highWaterMark: 0 });
  return jsonResponse(status, body);
}

/**
 * Reads a JSON body of at most BODY_LIMIT_BYTES, counted as it arrives (Content-Length may be absent or lie), within
 * CONN_BODY_MS (a drip gets 408), against `inFlight` for address bucket `from` (one declared up to SMALL_BODY_BYTES
 * against its allowance for small ones): reserved before reading, held until the runtime's read ends.
 */
async function readJsonBody(req: Request, inFlight: BytesInFlight, from: string, maxValues = JSON_VALUES_MAX) {
  const declared = declaredLength(req);
  const tooLarge = () => new HttpError(413, `body over ${BODY_LIMIT_BYTES} bytes`, true);
  if (declared !== null && declared > BODY_LIMIT_BYTES) throw tooLarge();
  let reserved = 0; // taken from inFlight
  const small = declared !== null && declared <= SMALL_BODY_BYTES;
  let reading: Promise<unknown> = Promise.resolve(); // the runtime's read: the reservation lasts as long
  let reader: ReadableStreamDefaultReader<Uint8Array> | undefined;
  const deadline = Promise.withResolvers<never>();
  const late = () => new HttpError(408, `the body was not all there ${CONN_BODY_MS / 1000} s after its headers`, true);
  const timer = setTimeout(() => deadline.reject(late()), CONN_BODY_MS);
  let text: string;
  try {
    if (declared !== null) {
      inFlight.take(from, declared, small);
      reserved = declared;
      // The server holds the body to its declared length. (Not touching req.body keeps Deno on its fast path.)
      text = await Promise.race([reading = req.text(), deadline.promise]);
      if (text === "") throw new HttpError(400, "empty body; expected JSON");
    } else {
      if (!req.body) throw new HttpError(400, "empty body; expected JSON");
      reader = req.body.getReader();
      const chunks: Uint8Array[] = [];
      for (;;) {
        const { done, value } = await Promise.race([reader.read(), deadline.promise]);
        if (done) break;
        if (reserved + value.length > BODY_LIMIT_BYTES) throw tooLarge();
        inFlight.take(from, value.length);
        reserved += value.length;
        chunks.push(value);
      }
      text = Buffer.concat(chunks).toString("utf8");
    }
  } catch (e) {
    if (reader) reading = reader.cancel().catch(() => {});
    if (e instanceof HttpError) throw e;
    // A malformed chunked encoding, a body cut off: the request's fault, never a 500.
    throw new HttpError(400, `the body could not be read (${(e as Error).message})`, true);
  } finally {
    clearTimeout(timer);
    const give = () => inFlight.give(from, reserved, small);
    reading.then(give, give);
  }
  const { depth, values } = jsonShape(text);
  if (depth > JSON_DEPTH_MAX) throw new HttpError(400, `body nests deeper than ${JSON_DEPTH_MAX} levels`);
  const many = `more than ${maxValues} JSON values (objects, arrays and members; a message holds about 15)`;
  if (values > maxValues) throw new HttpError(400, `body holds ${many}`);
  try {
    return JSON.parse(text) as unknown;
  } catch (e) {
    throw new HttpError(400, `body is not JSON (${(e as Error).message})`);
  }
}

/**
 * A request's declared body length, or null. A Content-Length sent twice reads "N, N", which RFC 9110 (8.6) lets us
 * take as N; any other value is a 400 (read as NaN, "no length", it let twenty 40 MB bodies hold a Bun bus at 850 MB).
 */
function declaredLength(req: Request): number | null {
  const raw = req.headers.get("content-length");
  if (raw === null) return null;
  const values = new Set(raw.split(",").map((v) => v.trim()));
  const [n] = values;
  if (values.size !== 1 || !/^\d{1,15}$/.test(n)) {
    throw new HttpError(400, `Content-Length ${JSON.stringify(raw.slice(0, 40))} is not one length in bytes`, true);
  }
  return Number(n);
}

function recipientParam(value: unknown, name: string): string {
  if (typeof value !== "string" || value === "") throw new HttpError(400, `"${name}" must be a non-empty string`);
  if (value.length > RECIPIENT_MAX_CHARS) {
    throw new HttpError(400, `"${name}" is longer than ${RECIPIENT_MAX_CHARS} characters`);
  }
  // Ack keys are `recipient + "\0" + seq:ts`; a NUL inside a recipient would let "a" ack the messages of "a\0x".
  if (value.includes("\0")) throw new HttpError(400, `"${name}" must not contain NUL`);
  return value;
}

/** Ed25519 by node:crypto, which a bus under Deno plugs into the node's verification (runBus; see useEd25519 for why). */
const NODE_ED25519 = {
  // RFC 8410's SubjectPublicKeyInfo for an Ed25519 key, then its 32 bytes
  key: (raw: Uint8Array) =>
    createPublicKey({
      key: Buffer.from(`302a300506032b6570032100${Buffer.from(raw).toString("hex")}`, "hex"),
      format: "der",
      type: "spki",
    }),
  verify: (key: unknown, sig: Uint8Array, signed: Uint8Array) =>
    Promise.resolve(verify(null, signed, key as KeyObject, sig)),
};

/** Who signed a payload, verified, its signature (Bus.send knows a copy by it) and ts; "" for an opaque payload. */
type Signer = { from: string; sig?: string; ts?: number };

/**
 * The verified signer of a v2-shaped payload, so room is shared fairly between senders; "" for any other (opaque, as
 * the reference contract says). A malformed or forged v2 payload is a 400: the bus never queues a known forgery, nor
 * one signed more than HELD_MAX_MS before `now`, which no node of ours takes (kept, it held its signer's budget).
 */
async function signerOf(payload: unknown, route: string, now: number): Promise<Signer> {
  if (!isV2Shaped(payload)) return { from: "" };
  let msg: SignedMessage;
  try {
    msg = parseSignedMessage(payload);
  } catch (e) {
    // A kind or field this version does not know (a newer node's): relayed as opaque, as the reference contract says.
    if (e instanceof FormatError) return { from: "" };
    throw e;
  }
  const bad = await verifyMessage(msg);
  if (bad) throw new HttpError(400, `the message's signature does not verify (${bad}); not queued`);
  // Else a copy of one of alice's messages, posted to other routes, would spend her budget and crowd her out.
  if (msg.to !== parseRoute(route).key) throw new HttpError(400, `addressed to ${fingerprint(msg.to)}, not this route`);
  const [age, most] = [now - msg.ts, HELD_MAX_MS].map((ms) => `${+(ms / 86_400_000).toFixed(1)} days`);
  if (now - msg.ts > HELD_MAX_MS) throw new HttpError(400, `signed ${age} ago, and no node takes one over ${most} old`);
  return { from: msg.from, sig: msg.sig, ts: msg.ts };
}

const isV2Shaped = (p: unknown): p is Record<string, string> =>
  isObject(p) && ["from", "to", "msg_id", "sig"].every((k) => typeof p[k] === "string");

/** The signer a stored payload claims, unverified; "" if it is not a v2 message. */
function claimedSigner(payload: string): Signer {
  try {
    const p = JSON.parse(payload);
    return isV2Shaped(p) ? { from: p.from, sig: p.sig, ts: Number(p.ts) } : { from: "" };
  } catch {
    return { from: "" };
  }
}

/** A body that names a "pubkey" (an announcement, an unregister), or the 400 that says `what` needs one. */
async function readKeyedBody(req: Request, inFlight: BytesInFlight, from: string, what: string) {
  const body = await readJsonBody(req, inFlight, from, ANNOUNCEMENT_VALUES_MAX);
  if (isObject(body) && typeof body.pubkey === "string" && body.pubkey !== "") return body;
  throw new HttpError(400, `${what} needs a "pubkey"`);
}

function parseOr400<T>(parse: () => T): T {
  try {
    return parse();
  } catch (e) {
    if (e instanceof FormatError) throw new HttpError(400, e.message);
    throw e;
  }
}

function recvTimeoutMs(raw: string | null): number {
  if (raw === null || raw === "") return RECV_TIMEOUT_MS;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < 0) {
    throw new HttpError(400, `timeout_ms must be a non-negative integer, got ${JSON.stringify(raw)}`);
  }
  return Math.min(n, RECV_TIMEOUT_MAX_MS);
}

/** A request URL's path and query, without building a URL object (every request; only /recv reads the query). */
function splitUrl(url: string): { pathname: string; query: string } {
  const m = /^(?:[a-z][a-z\d+.-]*:\/\/[^/?#]*)?([^?#]*)(?:\?([^#]*))?/i.exec(url)!;
  return { pathname: m[1] || "/", query: m[2] ?? "" };
}

// ============================================================================
// The queue database
// ============================================================================
//
// The queue is one SQLite database in the data folder, queue.db, through node:sqlite (which Bun and Deno ship):
//   message(seq, route, ts, sender, size, payload,  accepted and not yet acked (an ack deletes the row); sig: see
//     sig, origin, expires)                          QUEUE_SCHEMA_2, origin and expires QUEUE_SCHEMA_3 (NULL: none)
//   owner(key)                                       a key that proved it reads its routes here, never deleted
//   meta(name, value)                                "closed": since when every route needs a proof (Bus.#close);
//                                                    "imported": which queue.jsonl was taken in (extras/upgrade.ts)
// A seq is global and never reused (AUTOINCREMENT keeps the high-water mark), so an ack key names its message across
// restarts. Payloads stay JSON text end to end. message_route holds every column but the payload: a recv reads its
// heads there (the answer's weight is held before a payload is read), and a start counts what is held from it alone.
// auto_vacuum=FULL hands acked messages' pages back at each checkpoint (no compaction of ours); a checkpoint comes
// once the WAL holds WAL_PAGES and cuts it back to that, so the WAL an ack's delete goes through keeps its room.
// Durability: see Bus.#commit.

const QUEUE_SCHEMA = `
  CREATE TABLE message (seq INTEGER PRIMARY KEY AUTOINCREMENT, route TEXT NOT NULL, ts INTEGER NOT NULL,
    sender TEXT NOT NULL, size INTEGER NOT NULL, payload TEXT NOT NULL);
  CREATE INDEX message_route ON message (route, seq, ts, sender, size);
  CREATE TABLE owner (key TEXT PRIMARY KEY) WITHOUT ROWID;
  CREATE TABLE meta (name TEXT PRIMARY KEY, value) WITHOUT ROWID;
  PRAGMA user_version = 1;`;
/** Version 2: a signed message's signature, by which a copy of one queued already is known (Bus.send). */
const QUEUE_SCHEMA_2 = `ALTER TABLE message ADD COLUMN sig TEXT;
  UPDATE message SET sig = json_extract(payload, '$.sig') WHERE sender != '' AND json_valid(payload);
  CREATE INDEX message_sig ON message (sig) WHERE sig IS NOT NULL;
  PRAGMA user_version = 2;`;
/**
 * Version 3: each message's address bucket (BusQueues.admit; NULL: none) and expiry (expiryOf; NULL: its ts's); an
 * unsigned one held from before, which never expired, MESSAGE_STAY_MS after the upgrade. NULLs cost no bytes.
 */
const QUEUE_SCHEMA_3 = `ALTER TABLE message ADD COLUMN origin TEXT;
  ALTER TABLE message ADD COLUMN expires INTEGER;
  UPDATE message SET expires = CAST(strftime('%s') AS INTEGER) * 1000 + ${MESSAGE_STAY_MS} WHERE sender = '';
  UPDATE message SET expires = json_extract(payload, '$.ts') + ${MESSAGE_STAY_MS}
    WHERE sender != '' AND json_valid(payload) AND json_extract(payload, '$.ts') < ts;
  DROP INDEX message_route; CREATE INDEX message_route ON message (route, seq, ts, sender, size, origin, expires);
  PRAGMA user_version = 3;`;

/** The expires column of a message queued at `ts`, signed at `signed`: from its signing if before (NULL: from `ts`). */
const expiryOf = (ts: number, signed = Infinity) => (signed < ts ? signed + MESSAGE_STAY_MS : null);

/** SQLite's words for a full disk (Deno's errors carry no code) and for a damaged file. */
const sqliteFull = (e: unknown) => /database or disk is full|ENOSPC/i.test(String((e as Error)?.message));
const sqliteDamaged = (e: unknown) => /malformed|not a database|corrupt/i.test(String((e as Error)?.message));

/** The data folder's disk: free bytes and size (statfs); unknown counts as no limit (a write that fails says so). */
function diskOf(dir: string): { free: number; size: number } {
  try {
    const st = fs.statfsSync(dir);
    return { free: st.bavail * st.bsize, size: st.blocks * st.bsize };
  } catch {
    return { free: Infinity, size: Infinity };
  }
}

const reserveOf = (diskSize: number) => Math.min(DISK_RESERVE_BYTES, Math.floor(diskSize / 16));

/** The WAL's bound: a checkpoint once it holds this much, and cut back to it after (a 64th of a smaller disk). */
const walBytesOf = (diskSize: number) => 4096 * Math.max(1, Math.min(WAL_PAGES, Math.floor(diskSize / 64 / 4096)));

/** A commit whose fdatasync of the WAL failed (Bus.#flush): what it wrote is held, though maybe not on disk. */
class UnsyncedError extends HttpError {
  constructor(message: string) {
    super(503, message);
  }
}

/** extras/upgrade.ts's import of the queue.jsonl an earlier bus left: the skipped lines it set aside. */
type ImportJsonl = (db: DatabaseSync, file: string, log: (msg: string) => void) => number;

/**
 * The import of an earlier bus's queue.jsonl, loaded only when the data folder holds one (null when not). A bus.ts
 * copied alone refuses such a folder before it writes a byte, naming the file it needs.
 */
async function jsonlImporter(dataDir: string): Promise<ImportJsonl | null> {
  if (!fs.existsSync(path.join(dataDir, "queue.jsonl"))) return null;
  const where = import.meta.url.startsWith("file:") ? path.join(import.meta.dirname!, "extras", "upgrade.ts") : "";
  if (where && !fs.existsSync(where)) {
    throw new InterlinkError(
      `${dataDir} holds queue.jsonl, the queue of an earlier bus, and taking it in is not part of bus.ts: it is ` +
        `extras/upgrade.ts in interlink's repository, beside bus.ts. Clone the repository, or fetch that file to ` +
        `${where}, to start this bus there; nothing was changed.`,
    );
  }
  const { importJsonl } = await import("./extras/upgrade.ts");
  const queue = { claimedSigner, expiryOf, MESSAGE_STAY_MS, RECIPIENT_MAX_CHARS }; // what it shares with the queue
  return (db, file, log) => importJsonl(db, file, log, queue);
}

/**
 * Opens the data folder's queue.db (made 0600, which SQLite gives its -wal and -shm files too; tables on a new one)
 * and takes in a queue.jsonl an earlier bus left (`importJsonl`), synchronous=FULL until then. A file that is not a
 * queue database of this version, or that SQLite finds damaged, stops the start with what is wrong and what to do.
 */
function openQueue(dataDir: string, log: (msg: string) => void, importJsonl: ImportJsonl | null) {
  const file = path.join(dataDir, "queue.db");
  fs.closeSync(fs.openSync(file, "a", 0o600));
  let db: DatabaseSync | undefined;
  try {
    db = new DatabaseSync(file);
    const { user_version } = db.prepare("PRAGMA user_version").get() as { user_version: number };
    if (user_version > 3) throw new Error(`schema version ${user_version}, written by a later bus`);
    const wal = walBytesOf(diskOf(dataDir).size);
    db.exec(`PRAGMA auto_vacuum = FULL; PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
      PRAGMA wal_autocheckpoint = ${wal / 4096}; PRAGMA journal_size_limit = ${wal}`);
    db.exec(`BEGIN; ${[QUEUE_SCHEMA, QUEUE_SCHEMA_2, QUEUE_SCHEMA_3].slice(user_version).join(" ")} COMMIT;`); // from its version on
    const skippedLines = importJsonl?.(db, path.join(dataDir, "queue.jsonl"), log) ?? 0;
    syncDirectory(dataDir); // queue.db and its WAL made, queue.jsonl renamed: for good
    // The WAL as read now may hold frames that never reached the drive (a failed writeback leaves its pages clean in the
    // cache): copied into queue.db, synced, and the WAL emptied, before a commit goes behind them (Bus.#flush).
    db.exec("PRAGMA wal_checkpoint(TRUNCATE)");
    db.exec("PRAGMA synchronous = NORMAL"); // from here a commit's fsync is Bus.#flush's, off the event loop
    const sql = (text: string) => db!.prepare(text), one = (text: string) => sql(text).get() ?? {};
    const counts =
      "SELECT route, sender, origin, count(*) n, sum(size) b FROM message INDEXED BY message_route GROUP BY 1, 2, 3";
    return {
      db,
      skippedLines,
      counts: sql(counts).all() as { route: string; sender: string; origin: string | null; n: number; b: number }[],
      nextSeq: Number(one("SELECT seq FROM sqlite_sequence WHERE name = 'message'").seq ?? 0) + 1,
      owners: sql("SELECT key FROM owner").all().map((r) => r.key as string),
      closedSince: (one("SELECT value FROM meta WHERE name = 'closed'").value as number | undefined) ?? null,
    };
  } catch (e) {
    db?.close();
    if (!sqliteDamaged(e) && !/later bus|I\/O error/.test((e as Error).message)) throw e; // a disk that fails: said
    throw new InterlinkError(
      `the bus's queue database ${file} cannot be used (${(e as Error).message}); the bus took nothing out of it. ` +
        `Keep it and its -wal file: \`sqlite3 ${file} .recover\` prints what can still be read, as SQL. To serve ` +
        `again, start the bus on another --data folder, or move queue.db, queue.db-wal and queue.db-shm aside`,
    );
  }
}

// ============================================================================
// The bus
// ============================================================================

/** Defaults: QUEUE_LIMITS, OWNERS_MAX, ANSWERS_IN_FLIGHT_*, ANSWER_WRITE_MS, reserveOf the disk. */
interface BusOptions {
  limits?: Partial<QueueLimits>;
  owners?: number;
  answers?: { max?: number; perAddress?: number; writeMs?: number };
  diskReserve?: number;
  log?: (msg: string) => void;
  now?: () => number;
}

/** A queued message as message_route holds it (all but its payload), and as a receiver is handed it. */
type Head = { seq: number; ts: number; sender: string; size: number };
type BusDelivery = { seq: number; ts: number; payload: string };

/** A change for the next commit (Bus.#commit), and its caller's promise; `send`: a new message's route. */
type Write = PromiseWithResolvers<void> & { apply(): void; send?: string };

/** The durable bus: BusQueues and Roster behind a Request → Response handler, on its queue database. */
class Bus {
  readonly roster = new Roster();
  readonly inFlight = new BytesInFlight();
  readonly answers: BytesInFlight;
  readonly queues: BusQueues;
  nextSeq: number;
  readonly recovery: { messages: number; recipients: number; skippedLines: number; ms: number };
  // commits, the writes they carried, their fdatasyncs, and the commits made while an earlier one's fdatasync ran
  readonly commitStats = { commits: 0, writes: 0, syncs: 0, overlapped: 0 };
  features = BUS_FEATURES; // and how many sessions its connections allow (runBus)
  readonly ownersMax: number;
  readonly now: () => number;
  readonly #log: (msg: string) => void;
  readonly #opts: BusOptions; // a copy of open's: a caller changing its object afterwards changes no limit
  readonly #sql;
  // queue.db-wal, opened once for each fdatasync that may run at once (#flush): Linux tells a failed writeback once to
  // each open file, so with one descriptor a later commit's fdatasync could take the error an earlier one's pages made
  readonly #wal: number[];
  #walFree: number[]; // those no fdatasync uses now
  #waiters = new Map<string, Set<() => void>>(); // bounded: by the open long-polls
  #writes: Write[] = []; // what the next commit carries, in order: bounded by the requests waiting on it
  #flushing: Promise<void> | null = null; // the next group commit (#flush), or null while nothing waits
  #syncing: Promise<void>[] = []; // the commits whose fdatasync runs, oldest first: SYNCS_IN_FLIGHT at most
  #unreadable = new Set<number>(); // found damaged (#payload), skipped: bounded by the messages held
  #unsynced = new Map<string, { to: string; done: Promise<void> }>(); // signed sends not yet on disk, by sig: bounded
  #broken: HttpError | null = null; // an fdatasync of the WAL failed: every write is refused with this (#flush)
  readonly #expire = () => void this.expire().catch((e) => this.#log(`cannot drop expired mail: ${e.message}`));
  readonly #expiry = setInterval(this.#expire, 3600e3); // see expire
  readonly #owners: Set<string>; // keys that proved they read their routes here, never forgotten: ownersMax (#close)
  #closedSince: number | null; // since when every route needs a proof (#close), or null
  /** Route → the last proof whose signature verified, so a repeat skips the check (never the freshness one). */
  readonly #verified = new BoundedMap<string, string>(PROOFS_REMEMBERED); // bounded: forgetting costs one check
  #disk: { free: number; size: number; at: number }; // as last looked at: free (less writes since), size, when
  #reserved: boolean; // queue.reserve is there (#keepRoom)
  private readonly db: DatabaseSync;

  /** `stored`: what openQueue read; `started`: when open began, for the recovery report. */
  private constructor(
    readonly dataDir: string,
    stored: ReturnType<typeof openQueue>,
    private readonly lock: PidLock,
    opts: BusOptions,
    started: number,
  ) {
    const db = this.db = stored.db;
    this.#opts = { ...opts, answers: { ...opts.answers } };
    this.#log = opts.log ?? logInfo;
    this.now = opts.now ?? Date.now;
    this.ownersMax = opts.owners ?? OWNERS_MAX;
    const { max = ANSWERS_IN_FLIGHT_MAX, perAddress = ANSWERS_IN_FLIGHT_PER_ADDRESS } = this.#opts.answers!;
    this.answers = new BytesInFlight(max, perAddress, "answers not yet taken by their connections", false);
    const sql = (text: string) => db.prepare(text);
    this.#sql = {
      insert: sql("INSERT INTO message VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"), // as the schema's comment lists them
      copy: sql("SELECT route FROM message WHERE sig = ? AND sender = ?"),
      expired: sql("SELECT route, seq, ts FROM message INDEXED BY message_route WHERE ifnull(expires, ts + ?) < ?"),
      remove: sql(
        "DELETE FROM message WHERE seq = ? AND route = ? AND ts = coalesce(?, ts) RETURNING sender, size, origin",
      ),
      heads: sql(
        "SELECT seq, ts, sender, size FROM message INDEXED BY message_route WHERE route = ? ORDER BY seq LIMIT ?",
      ),
      payload: sql("SELECT payload FROM message WHERE seq = ?"),
      owner: sql("INSERT OR IGNORE INTO owner (key) VALUES (?)"),
      closed: sql("INSERT OR REPLACE INTO meta VALUES ('closed', ?)"),
      begin: sql("BEGIN IMMEDIATE"),
      commit: sql("COMMIT"),
    };
    this.#owners = new Set(stored.owners);
    this.queues = new BusQueues(opts.limits, (key) => this.#owners.has(key));
    for (const c of stored.counts) this.queues.add(c.route, c.sender, c.b, c.n, c.origin ?? "");
    this.nextSeq = stored.nextSeq;
    this.#closedSince = stored.closedSince;
    const { liveCount: messages, recipientCount: recipients } = this.queues;
    const ms = Math.round(performance.now() - started);
    this.recovery = { messages, recipients, skippedLines: stored.skippedLines, ms };
    const wal = path.join(dataDir, "queue.db-wal"), { O_RDWR, O_CREAT } = fs.constants;
    this.#wal = Array.from({ length: SYNCS_IN_FLIGHT }, () => fs.openSync(wal, O_RDWR | O_CREAT, 0o600));
    this.#walFree = [...this.#wal];
    this.#reserved = fs.existsSync(path.join(dataDir, "queue.reserve"));
    this.#disk = { ...diskOf(dataDir), at: -Infinity };
    this.#diskFree(); // makes queue.reserve if it is not there
    this.#expire();
  }

  /** Locks the data folder and opens its queue (openQueue): a start counts what is held, reading no message body. */
  static async open(dataDir: string, opts: BusOptions = {}): Promise<Bus> {
    const importJsonl = await jsonlImporter(dataDir);
    fs.mkdirSync(dataDir, { recursive: true, mode: 0o700 });
    const lock = await PidLock.acquire(path.join(dataDir, "bus.lock"), "interlink bus");
    const started = performance.now();
    let stored: ReturnType<typeof openQueue> | undefined;
    try {
      stored = openQueue(dataDir, opts.log ?? logInfo, importJsonl);
      return new Bus(dataDir, stored, lock, opts, started);
    } catch (e) {
      stored?.db.close();
      lock.release();
      throw e;
    }
  }

  /** Open long-polls right now (for tests). */
  get waiterCount(): number {
    return [...this.#waiters.values()].reduce((n, set) => n + set.size, 0);
  }

  /** `from`: the address the request came from (serveHttp says), for the per-address budgets; "" when unknown. */
  readonly handler = async (req: Request, from = ""): Promise<Response> => {
    const { pathname, query } = splitUrl(req.url);
    const [method, run] = BUS_ROUTES[pathname] ?? [];
    if (!run) return errorResponse(404, `no route ${pathname}; the bus serves ${Object.keys(BUS_ROUTES).join(", ")}`);
    if (req.method !== method) return errorResponse(405, `${pathname} takes ${method}`, { allow: method });
    if (from === NO_ADDRESS) return errorResponse(503, "the bus could not tell where this request came from; retry");
    try {
      const r = await run(this, req, { query, from: addressBucket(from) });
      // A reference bus sends no such header: our client batches only where it sees one; doctor reports it.
      r.headers.set("interlink-bus", this.features);
      return r;
    } catch (e) {
      // A body left unread must not keep its connection: "connection: close" and the server ends it after the answer.
      if (e instanceof HttpError) return errorResponse(e.status, e.message, e.close ? { connection: "close" } : {});
      if (req.signal.aborted) return errorResponse(499, "client closed the request"); // a hang-up: not an error here
      this.#log(`internal error on ${pathname}: ${(e as Error).stack ?? e}`);
      return errorResponse(500, "internal error; see the bus log");
    }
  };

  /**
   * Throws the 507 or 429 a message of `size` bytes from `sender` ("" when unknown) to `to` ("": not known yet) from
   * `origin` would get (BusQueues.admit), then the disk's 507. `close`: the body is unread (see HttpError).
   */
  ensureRoom(sender: string, size: number, to = "", origin = "", close = false): void {
    const over = this.queues.admit(sender, size, to, origin), l = this.queues.limits;
    if (over) {
      const counted = `payloads, ${MESSAGE_OVERHEAD_BYTES} bytes a message and ${ROUTE_OVERHEAD_BYTES} a route`;
      const [all, share, mine] = [1, l.unclaimedShare, l.addressShare].map((f) => humanBytes(f * l.totalBytes));
      const why = {
        global: `this bus holds its whole budget of ${all} of messages (${counted}); retry later`,
        unclaimed: `mail for keys that never proved a route here holds its ${share} share (${counted}); retry later`,
        address: `your address already has ${mine} queued on this bus, its share (${counted}); retry once read`,
        sender: `this sender already has ${humanBytes(l.senderBytes)} queued on this bus (${counted}); retry once read`,
      }[over];
      throw new HttpError(over === "global" || over === "unclaimed" ? 507 : 429, why, close);
    }
    this.#ensureDisk(2 * size + MESSAGE_OVERHEAD_BYTES, close); // in the WAL, then in the file at the checkpoint
  }

  /** Free bytes on the data folder's disk: looked up (statfs) at most every DISK_LOOK_MS, or `now`, less writes since. */
  #diskFree(now = false): number {
    const t = performance.now();
    if (now || t - this.#disk.at >= DISK_LOOK_MS) {
      this.#disk = { ...diskOf(this.dataDir), at: t };
      if (!this.#reserved && this.#disk.free >= 2 * reserveOf(this.#disk.size)) this.#keepRoom(true);
    }
    return this.#disk.free;
  }

  /**
   * Makes (`keep`) or deletes queue.reserve, the room acks need kept as a file of the reserve's size, which nothing
   * else that fills the disk can take: a commit of acks that meets a full disk deletes it and is tried once more
   * (#commit); it is made again once the disk has twice the reserve free. Whether it was there.
   */
  #keepRoom(keep: boolean): boolean {
    const was = this.#reserved;
    try {
      const file = path.join(this.dataDir, "queue.reserve");
      if (keep) writeFileAtomic(file, " ".repeat(reserveOf(this.#disk.size)));
      else fs.rmSync(file, { force: true });
      this.#reserved = keep;
    } catch {
      // tried again at the next look at the disk
    }
    return was;
  }

  /** Room kept free for what must always be written: acks, an owner's row, the "closed" row (see reserveOf). */
  diskReserve(): number {
    return this.#opts.diskReserve ?? reserveOf(this.#disk.size);
  }

  /** Throws the 507 for a write of `bytes` that would eat into the reserve (looked at afresh before refusing). */
  #ensureDisk(bytes: number, close = false): void {
    const room = (free: number) => free - bytes >= this.diskReserve();
    if (room(this.#diskFree()) || room(this.#diskFree(true))) return;
    const left = humanBytes(Math.max(0, this.#disk.free));
    const why =
      `the disk of the bus's data folder is full: ${left} free, which the bus keeps for acks; nothing was stored; retry once receivers have read their mail`;
    throw new HttpError(507, why, close);
  }

  /**
   * Throws the refusal a message of `size` bytes would get now: a copy of a signed message (`sender`, `sig`) queued for
   * another route (409: not new mail, and it would spend its signer's budget), a byte budget, a full route (429: nothing
   * accepted makes room, QUEUE_CAP), the 503 of a bus whose disk failed (#flush). One queued for `to` already (a retry)
   * is taken as it is: the promise it is on disk.
   */
  check(to: string, sender: string, size: number, sig?: string, origin = ""): Promise<void> | undefined {
    if (this.#broken) throw this.#broken; // a copy it finds may be one that failed to reach the disk
    const unsynced = sig ? this.#unsynced.get(sig) : undefined;
    const route = unsynced?.to ?? (sig && (this.#sql.copy.get(sig, sender) as { route: string } | undefined)?.route);
    if (route === to) return unsynced?.done ?? Promise.resolve(); // a sig found it
    if (route) {
      const why =
        `this signed message is queued on this bus already, for another route of its recipient: a copy is not new mail, and would spend its signer's budget; nothing was queued`;
      throw new HttpError(409, why);
    }
    this.ensureRoom(sender, size, to, origin);
    const held = this.queues.full(to, sender);
    if (held === null) return;
    const label = `${fingerprint(to)}${to.includes("#") ? to.slice(to.indexOf("#")) : ""}`;
    const what = sender ? "messages from this sender" : "unattributed payloads";
    const full =
      `${ROUTE_FULL}: ${label} holds ${held} ${what} not yet read, as many as this bus keeps; nothing was queued, and nothing queued before was dropped; retry once the recipient reads some`;
    throw new HttpError(429, full);
  }

  /**
   * Queues a message (see check); resolves once it is on stable storage (the 202). It counts against the budgets at
   * once, so one commit's sends meet the caps; a failed commit gives that back (a 507 on a full disk, else a 503).
   * Committed, it is handed to receivers before its fdatasync ends: a power cut then can lose it after a receiver had
   * it, unanswered, so its sender sends it again (the ts in an ack key keeps the lost one's key from acking the copy's
   * seq, given again). `origin`: the address bucket whose share it counts in ("": none).
   */
  async send(to: string, payload: string, sender = "", { sig, ts: signed }: Omit<Signer, "from"> = {}, origin = "") {
    const size = utf8Bytes(payload), queued = this.check(to, sender, size, sig, origin);
    if (queued) return await queued.catch((e) => Promise.reject(this.#unavailable(e)));
    const seq = this.nextSeq++, ts = this.now();
    this.queues.add(to, sender, size, 1, origin);
    this.#disk.free -= 2 * size + MESSAGE_OVERHEAD_BYTES;
    const row = [seq, to, ts, sender, size, payload, sig ?? null, origin || null, expiryOf(ts, signed)] as const;
    const done = this.#write(() => this.#sql.insert.run(...row), to);
    if (sig) this.#unsynced.set(sig, { to, done });
    try {
      await done;
    } catch (e) {
      if (!(e instanceof UnsyncedError)) this.queues.remove(to, sender, size, origin); // else committed: it is held
      throw this.#unavailable(e);
    } finally {
      if (sig) this.#unsynced.delete(sig);
    }
  }

  /**
   * Drops the messages over MESSAGE_STAY_MS old (expiryOf), opaque ones too: every node of ours refuses a signed one
   * as stale by then, so mail nobody reads holds its signer's and its address's budget that long at most. Open, hourly.
   */
  async expire(): Promise<void> {
    const old = this.#sql.expired.all(MESSAGE_STAY_MS, this.now()) as ({ route: string } & AckMark)[];
    await Promise.all(old.map((m) => this.ack(m.route, m)));
  }

  /** Hands `apply` to the next commit: resolves once that is on stable storage, rejects with why not. */
  #write(apply: () => void, send?: string): Promise<void> {
    if (this.#broken) return Promise.reject(this.#broken);
    const w = { ...Promise.withResolvers<void>(), apply, send };
    this.#writes.push(w);
    this.#flushing ??= this.#flush();
    return w.promise;
  }

  /**
   * Group commit, as the JSONL journal does it: what waits is committed in one transaction, whose COMMIT writes the WAL
   * without waiting for the disk (synchronous=NORMAL), then made durable by an fdatasync of the WAL on a thread of the
   * runtime's: synchronous=FULL's fsync after each commit, shared, and off the event loop (docs/durability.md). What
   * comes while an fdatasync runs is committed at the next turn with one of its own, SYNCS_IN_FLIGHT at most, so a write
   * waits for one fdatasync rather than for the one before to end first (on a disk slow to sync, that was most of its
   * wait). A batch is answered once its own fdatasync and every one before it ended well.
   *
   * An fdatasync that fails leaves the WAL with frames that may not be on disk, and SQLite's recovery drops every frame
   * after the first bad one: from then on a later fdatasync that succeeds (Linux tells each descriptor of a failed
   * writeback once) would answer 202 for what a restart loses. So the bus stops writing, as PostgreSQL stops on a failed
   * fsync: every send and ack is refused 503 until a restart (#own keeps a new owner in memory); recv still answers.
   */
  async #flush(): Promise<void> {
    await new Promise((turn) => setImmediate(turn)); // what else this turn hands over joins the commit
    while (this.#syncing.length >= SYNCS_IN_FLIGHT) await Promise.race(this.#syncing);
    if (this.#syncing.length) this.commitStats.overlapped++;
    const batch = this.#commit();
    this.#flushing = null; // in the same step as the commit: a write from now on is the next flush's
    if (!batch.length) return;
    // Committed, a message is read by every recv: a parked one is woken now, as the JSONL bus did (see send).
    for (const w of batch) for (const wake of (w.send && this.#waiters.get(w.send)) || []) wake();
    const fd = this.#walFree.pop()!; // one is free: fewer than SYNCS_IN_FLIGHT run
    const own = new Promise<void>((ok, fail) => fs.fdatasync(fd, (e) => (this.#walFree.push(fd), e ? fail(e) : ok())));
    const done = Promise.allSettled([own, ...this.#syncing]).then(([synced]) => {
      this.#syncing.splice(this.#syncing.indexOf(done), 1);
      if (synced.status === "rejected" && !this.#broken) {
        const at = new Date().toISOString(), why = (synced.reason as Error).message;
        const lost = `what was written since may not be on disk; the bus takes no write until it is restarted`;
        this.#broken = new HttpError(503, `the fdatasync of its WAL failed at ${at} (${why}): ${lost}`);
        this.#log(`${this.#broken.message} (recv still answers): check the disk (dmesg), then restart the bus`);
      }
      if (this.#broken) return void batch.forEach((w) => w.reject(new UnsyncedError(this.#broken!.message)));
      this.commitStats.syncs++;
      batch.forEach((w) => w.resolve());
    });
    this.#syncing.push(done);
  }

  /**
   * Commits what waits, and returns what was committed; what was not is rejected. A commit that fails (a full disk) is
   * tried again without its sends, so acks and owners never wait on room for new messages, and once more with the room
   * kept for them (#keepRoom).
   */
  #commit(): Write[] {
    let batch = this.#writes.splice(0);
    if (this.#broken) batch.forEach((w) => w.reject(this.#broken)); // handed over before it broke
    if (!batch.length || this.#broken) return [];
    let failed = this.#transact(batch);
    if (failed !== undefined) {
      for (const w of batch) if (w.send) w.reject(failed);
      batch = batch.filter((w) => !w.send);
      if (batch.length) failed = this.#transact(batch);
      if (failed !== undefined && batch.length && sqliteFull(failed) && this.#keepRoom(false)) {
        this.#log("the disk is full: the room kept for acks (queue.reserve) is given to them");
        failed = this.#transact(batch);
      }
    }
    if (failed === undefined) return batch;
    for (const w of batch) w.reject(failed);
    return [];
  }

  /** Runs `writes` in one transaction: undefined once it is committed, else why not (it is rolled back). */
  #transact(writes: Write[]): unknown {
    try {
      this.#sql.begin.run();
      for (const w of writes) w.apply();
      this.#sql.commit.run();
    } catch (e) {
      try {
        if (this.db.isTransaction) this.db.exec("ROLLBACK");
      } catch {
        // SQLite rolled it back itself (a full disk does)
      }
      return e ?? new Error("the commit failed");
    }
    this.commitStats.commits++;
    this.commitStats.writes += writes.length;
    return undefined;
  }

  #unavailable(e: unknown): HttpError {
    if (e instanceof HttpError) return e;
    const why = (e as Error)?.message ?? String(e);
    this.#log(`cannot write the queue database: ${why}`);
    return sqliteFull(e)
      ? new HttpError(507, `ENOSPC: the disk of the bus's data folder is full; nothing was written; retry later`)
      : new HttpError(503, `the bus cannot write its queue database (${why}); nothing was written; retry later`);
  }

  answerHold(from: string): AnswerHold {
    return new AnswerHold(this.answers, from, this.#opts.answers?.writeMs);
  }

  /** Whether `route`'s key has proven it reads its routes here: then every recv or ack of its routes needs a proof. */
  isOwned(route: string): boolean {
    return this.#owners.has(parseRoute(route).key);
  }

  get ownerCount(): number {
    return this.#owners.size;
  }

  get closedSince(): number | null {
    return this.#closedSince;
  }

  /**
   * Recipient ownership, trust on first proof: once a key has proven (a signed recv or ack) that it reads one of its
   * routes, unproven recv and ack of all its routes are refused for good, so nobody else reads or deletes its mail.
   * Keys that never proved work as in the reference contract until the bus closes (#close). Every proof, a repeat too,
   * must be fresh: a captured one is worth nothing RECV_PROOF_FRESH_MS after its ts. Throws the 403.
   */
  async checkOwnership(route: string, proof: unknown): Promise<void> {
    if (proof === undefined || proof === null || proof === "") {
      if (this.isOwned(route)) {
        const fp = fingerprint(route);
        const why =
          `route ${fp}… belongs to a key that has proven its ownership to this bus: a recv or ack for it must carry a proof signed by that key`;
        throw new HttpError(403, why);
      }
      if (this.#closedSince === null) return;
      const at = new Date(this.#closedSince); // a hand-made "c" record may hold a safe integer past what a Date holds
      const since = Number.isNaN(at.getTime()) ? `ts ${this.#closedSince}` : at.toISOString();
      const why =
        `this bus serves no route without a proof since ${since} (it could not record every key that proved its routes): a recv or ack must carry a proof signed by the route's key`;
      throw new HttpError(403, why);
    }
    if (typeof proof !== "string" || !/^\d{1,16}\.[A-Za-z0-9_-]{86}$/.test(proof)) {
      throw new HttpError(400, 'proof must be "<ts>.<signature>"');
    }
    const [tsText, sig] = proof.split(".");
    const ts = Number(tsText);
    if (Math.abs(this.now() - ts) > RECV_PROOF_FRESH_MS) {
      const window = `${RECV_PROOF_FRESH_MS / 60_000} min either side of this bus's clock`;
      throw new HttpError(403, `proof is outside its freshness window (${window})`);
    }
    if (this.#verified.get(route) !== proof) {
      const bad = await verifyDetached(parseRoute(route).key, sig, recvProofBytes(route, ts));
      if (bad) throw new HttpError(403, `proof does not verify for ${fingerprint(route)}…: ${bad}`);
    }
    this.#verified.set(route, proof);
    await this.#own(parseRoute(route).key);
  }

  /**
   * A key's first proof makes it an owner, committed before the answer (trust on first proof survives a restart); when
   * it cannot be one (`ownersMax` held, no disk room), the bus closes instead (#close).
   */
  async #own(key: string): Promise<void> {
    if (this.#owners.has(key)) return;
    let why = `it protects the routes of ${this.ownersMax} keys, the most it keeps (--owners), and never forgets one`;
    if (this.#owners.size < this.ownersMax) {
      try {
        // A failed drive (#flush) records no owner: the key is one in memory, until a restart records it at its next proof.
        if (!this.#broken) this.#ensureDisk(OWNER_ROW_BYTES);
        this.#owners.add(key); // at once: an unproven recv meanwhile is refused
        this.queues.ownerChanged(key);
        const undo = (e: unknown) => (this.#owners.delete(key), this.queues.ownerChanged(key), Promise.reject(e));
        await this.#write(() => this.#sql.owner.run(key)).catch((e) => this.#broken || undo(e)); // broken: kept
        const full =
          `this bus now protects ${this.ownersMax} keys, the most it keeps (--owners): the next new key closes it`;
        if (this.#owners.size === this.ownersMax) this.#log(full);
        return;
      } catch (e) {
        why = `it has no room to record one more key that proved its routes (${(e as Error).message})`;
      }
    }
    if (this.#closedSince === null) await this.#close(why);
  }

  /**
   * Closes the bus for good (restarts too), as its log line says, so keys it could not record are as safe as its owners:
   * a flood of keys, which cost nothing, ends here at no memory cost. The "closed" row goes into the disk's reserve;
   * this process stays closed even if that write fails (and throws).
   */
  async #close(why: string): Promise<void> {
    const since = this.#closedSince = this.now();
    this.#log(
      `closed: ${why}; from now on every recv and ack needs a proof from its route's key (nodes that never prove, as reference nodes, are refused)`,
    );
    await this.#write(() => this.#sql.closed.run(since)).catch((e) => Promise.reject(this.#unavailable(e)));
  }

  /** Up to `max` oldest un-acked messages for `me`, waiting up to `timeoutMs` for one ([] if none); kept until acked. */
  async recv(me: string, timeoutMs: number, signalOf?: () => AbortSignal, max = 1, held?: AnswerHold) {
    const ready = this.take(me, max, held);
    if (ready.length || timeoutMs <= 0) return ready;
    const signal = signalOf?.();
    if (signal?.aborted) return ready;
    await new Promise<void>((resolve) => {
      let set = this.#waiters.get(me);
      if (!set) this.#waiters.set(me, set = new Set());
      const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", done);
        set!.delete(done);
        if (set!.size === 0 && this.#waiters.get(me) === set) this.#waiters.delete(me);
        resolve();
      };
      const timer = setTimeout(done, timeoutMs);
      signal?.addEventListener("abort", done);
      set.add(done);
    });
    return this.take(me, max, held);
  }

  /**
   * Up to `max` oldest messages for `me`, at most RECV_BATCH_BYTES of payload (one at least); a damaged one is set
   * aside. `held` holds their answer's weight (or throws its 429 or 503) before a payload is read.
   */
  take(me: string, max: number, held?: AnswerHold): BusDelivery[] {
    if (!this.queues.held(me)) return []; // BusQueues counts every row: a parked recv asks first, and mostly for none
    for (;;) {
      const heads = (this.#sql.heads.all(me, max + this.#unreadable.size) as unknown as Head[])
        .filter((h) => !this.#unreadable.has(h.seq)).slice(0, max);
      let n = 0, bytes = 0;
      while (n < heads.length && (n === 0 || bytes + heads[n].size <= RECV_BATCH_BYTES)) bytes += heads[n++].size;
      heads.length = n;
      held?.hold(recvAnswerBytes(me, heads));
      const out = heads.map((h) => ({ seq: h.seq, ts: h.ts, payload: this.#payload(me, h) }))
        .filter((m): m is BusDelivery => m.payload !== undefined);
      if (out.length || !heads.length) return out;
    }
  }

  /**
   * `h`'s payload. One SQLite cannot read (a damaged page), or that is not JSON (a disk fault, a hand edit: it would go
   * into the answer as JSON), is said on stderr and skipped, never blocking the route behind it: one whose text reads
   * is kept in queue.db.corrupt and deleted, one that does not stays in the file for `sqlite3 .recover`.
   */
  #payload(me: string, h: Head): string | undefined {
    let text: unknown, why = "its payload is not JSON";
    try {
      text = this.#sql.payload.get(h.seq)?.payload;
      if (typeof text === "string") return (JSON.parse(text), text);
    } catch (e) {
      if (text === undefined && !sqliteDamaged(e)) throw e; // a failed read (EIO): this recv fails, the message stays
      if (text === undefined) why = (e as Error).message;
    }
    this.#unreadable.add(h.seq);
    let kept = "it stays in the file, skipped";
    try {
      if (typeof text === "string") {
        setAside(path.join(this.dataDir, "queue.db"), h.seq, why, text);
        kept = "set aside in queue.db.corrupt";
        void this.ack(me, h.seq).then(() => this.#unreadable.delete(h.seq), () => {});
      }
    } catch {
      // skipped, as unreadable
    }
    this.#log(`the queued message seq ${h.seq} for ${fingerprint(me)}… is damaged (${why}); ${kept}`);
  }

  /**
   * Acks `marks` of `me` (unknown ones ignored: idempotent): their rows are deleted in the next commit, on stable
   * storage before the answer, so neither a crash nor a power cut brings an acked message back. A delete takes a few
   * pages of the WAL, which the disk's reserve keeps: a full disk never stops receivers draining it.
   */
  async ack(me: string, ...marks: (number | AckMark)[]): Promise<void> {
    if (!marks.length) return;
    let gone: { sender: string; size: number; origin: string | null }[] = [];
    const remove = () => {
      gone = []; // a commit tried again runs this again
      for (const m of marks) {
        const { seq, ts = null } = typeof m === "number" ? { seq: m } : m;
        const row = this.#sql.remove.get(seq, me, ts) as (typeof gone)[number] | undefined;
        if (row) gone.push(row);
      }
    };
    const failed = await this.#write(remove).then(() => undefined, (e) => e);
    if (!failed || failed instanceof UnsyncedError) {
      for (const row of gone) this.queues.remove(me, row.sender, row.size, row.origin ?? "");
    }
    if (failed !== undefined) throw this.#unavailable(failed);
  }

  async close(): Promise<void> {
    clearInterval(this.#expiry);
    for (const set of this.#waiters.values()) for (const wake of set) wake();
    // What waits is committed, and answered, before the file closes: what comes during an fdatasync too (a flush of
    // its own, which the first look did not see).
    while (this.#flushing || this.#syncing.length) await Promise.all([this.#flushing, ...this.#syncing]);
    this.db.close();
    for (const fd of this.#wal) fs.closeSync(fd);
    this.lock.release();
  }
}

/**
 * Our extension of POST /send: {"messages": [{"to", "payload"}, ...]}, in order, each checked as a single send. The
 * first refused stops the rest, so a sender's order holds. Answered 200 once all queued are on disk, one result per
 * message tried: {"status": 202} or {"status": <4xx/5xx>, "error"}. A reference bus refuses the shape (no "to").
 */
async function sendMany(bus: Bus, items: unknown[], origin: string): Promise<Response> {
  if (!items.length || items.length > RECV_BATCH_MAX) {
    throw new HttpError(400, `"messages" must hold 1 to ${RECV_BATCH_MAX} messages`);
  }
  const results: { status: number; error?: string }[] = [];
  const failed = (e: unknown) =>
    e instanceof HttpError ? { status: e.status, error: e.message } : { status: 500, error: "internal" };
  const queued: Promise<void>[] = [];
  for (const item of items) {
    try {
      if (!isObject(item) || item.payload === undefined) throw new HttpError(400, 'each message is {"to", "payload"}');
      const to = recipientParam(item.to, "to");
      const payload = JSON.stringify(item.payload);
      const signer = await signerOf(item.payload, to, bus.now());
      bus.check(to, signer.from, utf8Bytes(payload), signer.sig, origin); // a refusal (a full route) stops the batch
      queued.push(bus.send(to, payload, signer.from, signer, origin)); // queued now, in order; on disk once awaited
      results.push({ status: 202 });
    } catch (e) {
      results.push(failed(e));
      break;
    }
  }
  (await Promise.allSettled(queued)).forEach((r, i) => {
    if (r.status === "rejected") results[i] = failed(r.reason);
  });
  return jsonResponse(200, JSON.stringify({ status: "queued", results }));
}

/** A route's method and handler, told the request's query string and address bucket (see addressBucket). */
type BusRoute = [
  method: string,
  handle: (bus: Bus, req: Request, call: { query: string; from: string }) => Promise<Response>,
];

const BUS_ROUTES: Record<string, BusRoute> = {
  "/send": ["POST", async (bus, req, { from }) => {
    const origin = from === LOOPBACK ? "" : from; // this machine's own processes: held to no address's share
    // A body that could not fit the budgets is refused unread: a flood of big bodies costs no memory.
    const declared = declaredLength(req) ?? 0;
    if (declared > 0) bus.ensureRoom("", declared, "", origin, true);
    const body = await readJsonBody(req, bus.inFlight, from);
    if (isObject(body) && Array.isArray(body.messages)) return await sendMany(bus, body.messages, origin);
    if (!isObject(body)) throw new HttpError(400, 'expected {"to": <recipient>, "payload": <any JSON>}');
    const to = recipientParam(body.to, "to");
    if (body.payload === undefined) throw new HttpError(400, '"payload" is missing');
    const signer = await signerOf(body.payload, to, bus.now());
    await bus.send(to, JSON.stringify(body.payload), signer.from, signer, origin);
    return jsonResponse(202, '{"status":"queued"}');
  }],
  "/recv": ["GET", async (bus, req, { query, from }) => {
    const params = new URLSearchParams(query);
    const me = recipientParam(params.get("me"), "me");
    await bus.checkOwnership(me, params.get("proof"));
    // Our extension: max=N (2 to RECV_BATCH_MAX) answers up to N at once, in another shape ("messages") that no
    // client which did not ask can take for one message; a reference bus ignores max and answers one.
    const max = Math.max(1, Math.min(Math.floor(Number(params.get("max"))) || 1, RECV_BATCH_MAX)); // junk: 1
    const held = bus.answerHold(from);
    // The request's signal is read only when the recv has to wait (under Deno, building it costs).
    const got = await bus.recv(me, recvTimeoutMs(params.get("timeout_ms")), () => req.signal, max, held);
    if (!got.length) return jsonResponse(200, '{"status":"timeout"}');
    const entry = (m: BusDelivery) =>
      `"envelope":{"payload":${m.payload},"ts":${m.ts}},"ack":${JSON.stringify(ackKey(me, m))}`;
    const text = max > 1
      ? `{"status":"messages","messages":[${got.map((m) => `{${entry(m)}}`)}]}`
      : `{"status":"message",${entry(got[0])}}`;
    return streamedAnswer(200, text, held);
  }],
  "/ack": ["POST", async (bus, req, { from }) => {
    const body = await readJsonBody(req, bus.inFlight, from);
    if (!isObject(body)) throw new HttpError(400, 'expected {"me": <recipient>, "ack": <key>}');
    const me = recipientParam(body.me, "me");
    // Our extension: "acks", a list of keys, in place of the reference's single "ack".
    const keys: unknown[] = Array.isArray(body.acks) ? body.acks : [body.ack];
    if (!keys.length || keys.length > RECV_BATCH_MAX || !keys.every((k) => typeof k === "string")) {
      throw new HttpError(400, `"ack" must be a string (or "acks" a list of 1 to ${RECV_BATCH_MAX})`);
    }
    if (!keys.every((k) => (k as string).startsWith(me + "\0"))) {
      throw new HttpError(403, "that ack key belongs to another recipient");
    }
    await bus.checkOwnership(me, body.proof);
    // Unknown or already acked: still 200, acks are idempotent.
    await bus.ack(me, ...(keys as string[]).map((k) => parseAckKey(me, k)).filter((m) => m !== undefined));
    return jsonResponse(200, '{"status":"acked"}');
  }],
  "/announce": ["POST", async (bus, req, { from }) => {
    const body = await readKeyedBody(req, bus.inFlight, from, "an announcement");
    delete body.age_ms; // stamped by the bus, never taken from the poster
    const json = JSON.stringify(body);
    if (utf8Bytes(json) > ANNOUNCEMENT_MAX_BYTES) {
      throw new HttpError(413, `announcement over ${ANNOUNCEMENT_MAX_BYTES} bytes`);
    }
    const a = parseOr400(() => parseAnnouncement(body));
    const now = bus.now();
    // Presence must be current: no announcement from the future, none older than the roster keeps.
    if (a.ts - now > FRESH_FUTURE_MS) throw new HttpError(400, `announcement ts is ${a.ts - now} ms in the future`);
    if (now - a.ts >= ROSTER_RETENTION_MS) throw new HttpError(400, "announcement is older than the roster keeps");
    const bad = await verifyAnnouncement(a);
    if (bad) throw new HttpError(403, `announcement signature does not verify: ${bad}`);
    const filed = bus.roster.put(a, json, now, from);
    if (filed === true || filed === "older") return jsonResponse(202, '{"status":"announced"}'); // older: superseded
    const { cap, perKeyCap, perAddressCap } = bus.roster;
    const live = `heard from in the last ${PRESENCE_LIVE_MS / 1000} s`;
    const session = fingerprint(a.pubkey) + (a.session?.session_id ? `#${a.session.session_id.slice(0, 128)}` : "");
    const why = {
      ended:
        `session ${session} was ended by its key (a signed unregister) after this announcement was signed; it is not listed again`,
      full:
        `this bus's roster is full of sessions ${live} (${cap} KiB of announcements); this one is not listed now: a session away longer gives way to it`,
      key:
        `this key's sessions take ${perKeyCap} KiB of this bus's roster already, each signed later than this announcement; it is not listed`,
      address:
        `announcements from your address take ${perAddressCap} KiB of this bus's roster already, all of them ${live}; this one is not listed now`,
    }[filed];
    throw new HttpError({ ended: 409, full: 507, key: 429, address: 429 }[filed], why);
  }],
  "/unregister": ["POST", async (bus, req, { from }) => {
    const body = await readKeyedBody(req, bus.inFlight, from, "an unregister");
    const unsigned =
      "unsigned unregister refused: only the key that announced a session may remove it (interlink-unregister-v1); the entry ages out to away by itself";
    if (body.sig === undefined) throw new HttpError(403, unsigned);
    const { session } = body;
    const sessionId = isObject(session) && typeof session.session_id === "string" ? session.session_id : "";
    const u = parseOr400(() => ({ pubkey: field(body, "pubkey"), ts: timestamp(body, "ts"), sig: field(body, "sig") }));
    const now = bus.now();
    const stale = u.ts - now > FRESH_FUTURE_MS || now - u.ts > UNREGISTER_FRESH_MS;
    if (stale) throw new HttpError(400, "unregister ts is outside the freshness window");
    const signed = parseOr400(() => unregisterBytes({ ...u, session_id: sessionId }));
    const bad = await verifyDetached(u.pubkey, u.sig, signed);
    if (bad) throw new HttpError(403, "unregister signature does not verify");
    bus.roster.end(sessionId ? `${u.pubkey}#${sessionId}` : u.pubkey, u.ts, from, now);
    return jsonResponse(202, '{"status":"unregistered"}');
  }],
  "/roster": ["GET", (bus, _req, { from }) => {
    const held = bus.answerHold(from);
    held.hold(bus.roster.answerBytes()); // before the answer is made: a refused read costs nothing
    return Promise.resolve(streamedAnswer(200, `{"roster":[${bus.roster.list(bus.now()).join(",")}]}`, held));
  }],
};

// ============================================================================
// Serving HTTP
// ============================================================================

// One server under Bun and Deno, HTTP/1.1 on node:net, strict about what strangers send and bounded where the runtimes'
// own are not (Bun.serve past the descriptor limit spun a core; Deno.serve never closes an idle connection) at a third
// less CPU than node:http. A request's head comes within HEAD_MAX_BYTES and CONN_IDLE_MS of the connection's opening or
// its last answer, however it trickles; a body within CONN_BODY_MS of its first read, read only when the handler asks;
// no deadline while the handler works (a long-poll waits a minute). A client gone aborts its request's signal.

type Listening = { port: number; connections: number; stop(): Promise<void> }; // connections: see connectionBound
type FetchHandler = (req: Request, from: string) => Promise<Response>;
type RequestHead = { method: string; target: string; version: string; headers: Map<string, string> };

const TOKEN = "[!#$%&'*+\\-.^_`|~0-9A-Za-z]+";
const REQUEST_LINE = new RegExp(`^(${TOKEN}) (/[!-~]*) HTTP/1\\.([01])$`);
// One pass, its spaces trimmed after: a pattern that trims them backtracks on a line of spaces ending in a NUL
// (16 KB of them took half a second of CPU, the event loop stopped), quadratic in the line.
const HEADER_LINE = new RegExp(`^(${TOKEN}):([^\\0\\r\\n]*)$`);
const FRAMING = new Set(["connection", "content-length", "transfer-encoding"]); // the server's to write
let REASONS: Record<number, string | undefined> = {}; // node:http's reason phrases, loaded with the server

/** A request head, or why it is refused: a length a proxy in front could read otherwise (smuggling) never passes. */
function parseHead(text: string): RequestHead | string {
  const lines = text.split("\r\n"), line = REQUEST_LINE.exec(lines[0]);
  if (!line) return "a malformed request line (expected: METHOD /path HTTP/1.1)";
  const headers = new Map<string, string>();
  for (let i = 1; i < lines.length; i++) {
    const h = HEADER_LINE.exec(lines[i]); // no folded line, bare CR or LF, NUL, or space before the colon
    if (!h) return `a malformed header line: ${JSON.stringify(lines[i].slice(0, 60))}`;
    const v = h[2], name = h[1].toLowerCase(), was = headers.get(name);
    let a = 0, b = v.length;
    while (v[a] === " " || v[a] === "\t") a++;
    while (b > a && (v[b - 1] === " " || v[b - 1] === "\t")) b--;
    headers.set(name, was === undefined ? v.slice(a, b) : `${was}, ${v.slice(a, b)}`);
  }
  const te = headers.get("transfer-encoding"), cl = headers.get("content-length"), expect = headers.get("expect");
  if (te !== undefined && cl !== undefined) return "both Transfer-Encoding and Content-Length";
  if (te !== undefined && te.toLowerCase() !== "chunked") return "a Transfer-Encoding other than chunked";
  if (cl !== undefined && !/^\d{1,15}$/.test(cl)) return "Content-Length is not one length in bytes";
  if (expect !== undefined && expect.toLowerCase() !== "100-continue") return "Expect other than 100-continue";
  return { method: line[1], target: line[2], version: line[3], headers };
}

/** An answer's head and `body` (left out when `bare`), or a streamed answer's head when `body` is null. */
function answerHead(status: number, fields: [string, string][], body: string | null, bare = false): string {
  let head = `HTTP/1.1 ${status} ${REASONS[status] ?? ""}\r\n`;
  for (const [k, v] of fields) head += `${k}: ${v}\r\n`;
  if (body === null) return head + "\r\n";
  return `${head}content-length: ${Buffer.byteLength(body)}\r\n\r\n${bare ? "" : body}`;
}

/** A refusal the server answers itself, as the handler's are worded ({"error"}), closing the connection after it. */
const closingAnswer = (status: number, why: string) =>
  answerHead(status, [["content-type", "application/json"], ["connection", "close"]], JSON.stringify({ error: why }));

/** A handler that throws: a generic 500, the error logged; never a runtime's page of paths and source lines. */
function serverError(e: unknown): Response {
  logWarn(`a request failed inside the server: ${(e as Error)?.stack ?? e}`);
  return new Response("internal error\n", { status: 500, headers: { "content-type": "text/plain; charset=utf-8" } });
}

/** CONN_MAX, or the process's file-descriptor limit less some room for the queue file and the like. */
function connectionBound(): number {
  let limit = NaN;
  try {
    // Linux: no process to start (nor a permission to ask for under Deno).
    limit = Number(fs.readFileSync("/proc/self/limits", "utf8").match(/^Max open files\s+(\d+)/m)?.[1]);
  } catch {
    limit = Number(spawnSync("sh", ["-c", "ulimit -n"], { encoding: "utf8" }).stdout?.trim());
  }
  return Number.isSafeInteger(limit) && limit > 0 ? Math.max(16, Math.min(CONN_MAX, limit - 64)) : CONN_MAX;
}

/** One connection: its requests parsed and answered in order. `deadlines`: when each connection is closed. */
function serveConnection(socket: net.Socket, handler: FetchHandler, host: string, deadlines: Map<net.Socket, number>) {
  const from = socket.remoteAddress || NO_ADDRESS; // after a reset the socket has none
  let buf = Buffer.alloc(0) as Buffer, gone: AbortController | null = null, wake: (() => void) | null = null;
  let closing = false, ended = false, drained = () => {}; // `ended`: the client half-closed, answered still
  // Never set again once closed: its entry, swept and never deleted, held a connection of the bound for good.
  const due = (at: number) => void (socket.destroyed || deadlines.set(socket, at));
  due(Date.now() + CONN_IDLE_MS);
  const refuse = (status: number, why: string) => {
    closing = true;
    socket.end(closingAnswer(status, why));
  };
  const nextRequest = () => {
    while (!gone && !closing) {
      let start = 0;
      while (buf[start] === 13 || buf[start] === 10) start++; // blank lines before a request (RFC 9112, 2.2)
      const end = buf.indexOf("\r\n\r\n", start);
      if ((end < 0 ? buf.length : end) - start > HEAD_MAX_BYTES) {
        return refuse(431, `request line and headers over ${HEAD_MAX_BYTES} bytes`);
      }
      if (end < 0) return void (buf = buf.subarray(start), ended && socket.end());
      const head = parseHead(buf.toString("latin1", start, end));
      buf = buf.subarray(end + 4);
      if (typeof head === "string") return refuse(head.startsWith("Expect") ? 417 : 400, head);
      void serveRequest(head);
    }
  };
  const more = () => new Promise<void>((resolve) => (wake = resolve, socket.resume())).then(() => void (wake = null));
  async function serveRequest({ method, target, version, headers }: RequestHead) {
    const aborted = gone = new AbortController();
    due(Infinity);
    const chunked = headers.has("transfer-encoding");
    let left = Number(headers.get("content-length") ?? 0), whole = !chunked && !left, size = -1, started = false;
    const done = () => (whole = true, due(Infinity), null);
    // The body's next bytes, within CONN_BODY_MS of the first read; null once all read. `size`, chunked: the bytes
    // left of this chunk; -1 its size line next, -2 its CRLF, 0 the trailer. A malformed body throws (the handler's 400).
    // `got`: the chunks at hand, handed on as one (a view of the socket's buffer each, 2 MB of one-byte chunks were
    // two million views: 500 MB of a Bun bus's memory against the 2 MiB its budget counted).
    const take = async (): Promise<Uint8Array | null> => {
      if (whole) return null;
      if (!started && headers.has("expect")) socket.write("HTTP/1.1 100 Continue\r\n\r\n");
      if (!started) (started = true, due(Date.now() + CONN_BODY_MS));
      const got: Uint8Array[] = [];
      for (;;) {
        if (socket.destroyed) throw new Error("the connection closed before the body's end");
        const eol = chunked && size <= 0 ? buf.indexOf("\r\n") : 0;
        if (!buf.length || eol < 0) {
          if (got.length) return Buffer.concat(got);
          if (buf.length > 1024) throw new Error("a chunk size or trailer line over 1 KiB");
          if (ended) throw new Error("the client ended its side before the body's end");
          await more();
        } else if (!chunked || size > 0) {
          const piece = buf.subarray(0, chunked ? size : left);
          buf = buf.subarray(piece.length);
          if (chunked) (size = size - piece.length || -2, got.push(piece));
          else return (left -= piece.length, left || done(), piece);
        } else if (size !== -1) {
          if (size === -2 && eol) throw new Error("a chunk longer than its size");
          // A trailer line is a header line: "0\r\n\nGET ..." ends the body for a proxy that takes a bare LF.
          if (!size && eol && !HEADER_LINE.test(buf.toString("latin1", 0, eol))) throw new Error("a malformed trailer");
          buf = buf.subarray(eol + 2);
          if (size === -2) size = -1;
          else if (!eol) return done();
        } else {
          const line = /^([0-9a-fA-F]{1,7})(;[^\r\n]*)?$/.exec(buf.toString("latin1", 0, eol));
          if (!line) throw new Error("a malformed chunk size");
          buf = buf.subarray(eol + 2);
          size = parseInt(line[1], 16);
          if (!size && got.length) return Buffer.concat(got); // the last chunk's trailer next
        }
      }
    };
    const text = async () => {
      const chunks: Uint8Array[] = [];
      for (let n = 0, c = await take(); c && n <= BODY_LIMIT_BYTES; c = await take()) (chunks.push(c), n += c.length);
      return Buffer.concat(chunks).toString("utf8");
    };
    // The handler reads only these parts of a Request; a real one costs more than the rest of the server.
    const reader = { read: async () => ({ value: await take(), done: whole }), cancel: async () => {} }; // see `after`
    const lite = {
      url: `http://${host}${target}`,
      method,
      headers: { get: (name: string) => headers.get(name.toLowerCase()) ?? null },
      body: chunked ? { getReader: () => reader } : null,
      text,
      json: async () => JSON.parse(await text()),
      signal: aborted.signal,
    };
    // A handler that throws while the client is still there gets the generic 500; one that is gone, nothing.
    const r = await handler(lite as unknown as Request, from).catch((e) =>
      aborted.signal.aborted ? null : serverError(e)
    );
    if (!r || socket.destroyed) return void r?.body?.cancel().catch(() => {});
    const asked = headers.get("connection")?.toLowerCase() ?? "";
    const keep = whole && r.headers.get("connection") !== "close" &&
      (version === "1" ? asked !== "close" : asked === "keep-alive");
    const fields = [...r.headers].filter(([k]) => !FRAMING.has(k));
    fields.push(["connection", keep ? "keep-alive" : "close"]);
    // A body left unread (refused, or past the limit) is not waited for: the connection closes after the answer.
    const after = whole ? undefined : () => socket.destroy();
    const known = WHOLE_ANSWERS.get(r) ?? (r.body ? undefined : "");
    if (known !== undefined) socket.write(answerHead(r.status, fields, known, method === "HEAD"), after);
    else if (method === "HEAD") { // its head only: a body after it would read as the next answer (the board's 405)
      void r.body!.cancel().catch(() => {});
      socket.write(answerHead(r.status, [...fields, ["transfer-encoding", "chunked"]], null), after);
    } else {
      // A slice at a time, each once the one before went to the kernel; a close cancels the stream (its bytes back).
      socket.write(answerHead(r.status, [...fields, ["transfer-encoding", "chunked"]], null));
      const slices = r.body!.getReader();
      aborted.signal.addEventListener("abort", () => slices.cancel().catch(() => {})); // an event stream too
      try {
        for (let c = await slices.read(); !c.done; c = await slices.read()) {
          socket.write(`${c.value.length.toString(16)}\r\n`), socket.write(c.value);
          due(Date.now() + CONN_IDLE_MS); // a slice not taken: closed (waited for forever, before)
          await new Promise((written) => socket.write("\r\n", written));
          due(Infinity); // the stream's next slice: an event stream may wait long for it
          if (socket.destroyed) throw new Error("gone");
        }
        if (aborted.signal.aborted) throw new Error("cut short"); // never a short answer ended as if whole
        socket.write("0\r\n\r\n", after);
      } catch {
        return void socket.destroy(); // its close cancels the stream
      }
    }
    due(Date.now() + CONN_IDLE_MS); // for the next request, or for the client to take this answer
    if (!whole || !keep) return void (closing = true, whole && socket.end());
    // The next pipelined request once the kernel took this answer: a client that reads none is not answered into
    // memory (8 MB of requests held a Bun bus at 600 MB), and the deadline above closes it.
    if (socket.writableNeedDrain) await new Promise<void>((r) => socket.once("drain", drained = () => r())); // or close
    if (!socket.destroyed) (gone = null, socket.resume(), nextRequest()); // one cut: what it sent after, unanswered
  }
  socket.on("error", () => {}); // a reset: its close follows
  socket.on("close", () => (deadlines.delete(socket), gone?.abort(), wake?.(), drained())); // no listener left per wait
  // A request in flight at the client's end: a long-poll or a stream is given up (its client may be gone for good).
  socket.on("end", () => (ended = true, wake ? wake() : gone ? gone.abort() : nextRequest()));
  socket.on("data", (d: Buffer) => {
    if (closing) return;
    buf = buf.length ? Buffer.concat([buf, d]) : d;
    if (wake) wake();
    else if (!gone) nextRequest();
    else if (buf.length > HEAD_MAX_BYTES) socket.pause(); // a pipelined request: resumed once this one is answered
  });
}

/** Binds a fetch handler, told each request's source address, to a TCP port (see the top of this section). */
async function serveHttp(handler: FetchHandler, hostname: string, port: number): Promise<Listening> {
  const [{ createServer, connect }, http] = await Promise.all([import("node:net"), import("node:http")]);
  REASONS = http.STATUS_CODES;
  const most = connectionBound(), sessions = `${most} connections (about ${most >> 1} sessions)`;
  const busy = `this bus holds the ${sessions} its descriptor limit allows; retry later`;
  // A source address holds a quarter of them at most (LOOPBACK: this machine's sessions, the whole): one host's 10,000
  // held connections told every other client 503. `held`: bounded, an entry per address holding one.
  const held = new Map<string, number>(), share = most >> 2;
  const yours = `your address holds ${share} connections, its share of this bus; retry later`;
  const deadlines = new Map<net.Socket, number>(); // each open connection's: closed once past it (Infinity: none)
  const sweep = setInterval(() => { // a second late at most, as node:http's check was
    const now = Date.now();
    for (const [socket, at] of deadlines) if (at < now) socket.destroy();
  }, 1000);
  // Past the bound a newcomer is answered 503 and closed, CONN_TURNED_AWAY_MAX at once (the rest closed unanswered),
  // so an accept never fails: under Bun that spins a core, under Deno it stops accepting. `accepted`: see the watchdog.
  let accepted = 0, turning = 0, saidAt = -Infinity;
  // Half-open: a client that ends its side after its requests (as `nc -N` does) is still answered; it was not, its
  // send queued all the same.
  const server = createServer({ noDelay: true, allowHalfOpen: true }, (socket) => {
    accepted++;
    const bucket = addressBucket(socket.remoteAddress ?? ""), mine = bucket !== LOOPBACK && held.get(bucket)! >= share;
    if (deadlines.size < most && !mine) {
      (addCount(held, bucket, 1), socket.once("close", () => addCount(held, bucket, -1)));
      return serveConnection(socket, handler, hostname, deadlines);
    }
    if (turning >= CONN_TURNED_AWAY_MAX) return void socket.destroy();
    if (!mine && Date.now() - saidAt > 60_000) {
      saidAt = Date.now();
      logWarn(`holding the ${sessions} its file-descriptor limit allows: newcomers are told 503 (once a minute)`);
    }
    turning++;
    // Told at its request, or a second after it came without one: a bus that stalled reads it late, and the 503 answers
    // what it sends meanwhile (it went unanswered, a second being short on a loaded machine). Closed a second later.
    let said = false;
    const say = () => void (said || (said = true, socket.end(closingAnswer(503, mine ? yours : busy))));
    const late = setTimeout(say, 1000), gone = setTimeout(() => socket.destroy(), 2000);
    socket.on("error", () => {}).once("close", () => (turning--, clearTimeout(late), clearTimeout(gone)));
    socket.once("data", say);
  });
  server.on("error", (e) => logWarn(`the HTTP server: ${(e as Error).message}`));
  await new Promise<void>((resolve, reject) => (server.once("error", reject), server.listen(port, hostname, resolve)));
  const bound = (server.address() as net.AddressInfo).port; // the port, kept when listening anew
  // Past the file-descriptor limit, node:net under Deno stops accepting, silently and for good: every few seconds a
  // connection to ourselves checks one is still accepted; if not, it listens anew.
  const watchdog = setInterval(() => {
    const before = accepted;
    const at = hostname === "0.0.0.0" ? "127.0.0.1" : hostname === "::" ? "::1" : hostname;
    const probe = connect(bound, at);
    probe.on("error", () => {});
    setTimeout(() => {
      probe.destroy();
      if (accepted > before) return;
      logWarn(`the HTTP listener on port ${bound} stopped accepting (out of file descriptors?); listening again`);
      server.close();
      server.listen(bound, hostname);
    }, CONN_PROBE_MS).unref?.();
  }, CONN_PROBE_MS * 2);
  const stop = () => {
    (clearInterval(watchdog), clearInterval(sweep));
    for (const socket of deadlines.keys()) socket.destroy();
    return new Promise<void>((resolve) => server.close(() => resolve()));
  };
  return { port: bound, connections: most, stop };
}

// ============================================================================
// CLI
// ============================================================================

async function runBus(o: Options): Promise<number> {
  const int = (name: string, min: number, max: number) => intOption(o[name], name, min, max);
  const host = o.host as string, dataDir = o.data as string;
  const port = int("port", 0, 65535), cap = int("cap", 1, 10_000_000);
  const limits = {
    cap,
    opaqueCap: int("opaque-cap", 1, 10_000_000),
    senderBytes: int("sender-mb", 1, 1_000_000) * 2 ** 20,
    totalBytes: int("max-mb", 1, 1_000_000) * 2 ** 20,
  };
  const owners = int("owners", 1, 100_000_000);
  if (!["on", "off"].includes(String(o.guard))) throw new InterlinkError(`--guard must be on or off, not '${o.guard}'`);
  setLogComponent("interlink bus");
  if (runtimeHost.Deno) useEd25519(NODE_ED25519); // under Bun, WebCrypto's keeps the event loop free
  const bus = await Bus.open(dataDir, { limits, owners });
  const server = await serveHttp(bus.handler, host, port).catch(async (e) => {
    await bus.close();
    throw new InterlinkError(`cannot listen on ${host}:${port}: ${(e as Error).message}`);
  });
  const r = bus.recovery, at = host.includes(":") ? `[${host}]` : host;
  const most = server.connections, sessions = most >> 1;
  const room = `its file-descriptor limit allows ${most} connections (about ${sessions} sessions)`;
  logInfo(`listening on http://${at}:${server.port} (data ${dataDir}, cap ${cap} per sender and recipient; ${room})`);
  bus.features += ` sessions=${sessions}`;
  const skipped = r.skippedLines ? `; skipped ${r.skippedLines} unreadable lines` : "";
  logInfo(`recovered ${r.messages} un-acked messages for ${r.recipients} recipients in ${r.ms} ms${skipped}`);
  if (!isLoopback(host)) logWarn(`bound to ${host}, not loopback: ${BUS_EXPOSURE}`);
  logInfo(`${await shutdownSignal()}: shutting down`);
  await server.stop();
  await bus.close();
  return 0;
}

export const command: CommandSpec = {
  summary: "run the durable keep-until-ack relay that nodes talk through",
  about: "Speaks the interlink-bus HTTP API (POST /send, GET /recv, POST /ack, POST /announce,\n" +
    "GET /roster, POST /unregister; batched recv and ack as extensions). A message answered 202 is on disk;\n" +
    "it is delivered until its recipient acks it.",
  options: {
    host: option("HOST", "INTERLINK_BUS_HOST", "127.0.0.1", "address to bind (non-loopback prints a warning)"),
    port: option("PORT", "INTERLINK_BUS_PORT", String(DEFAULT_BUS_PORT), "TCP port; 0 picks a free one"),
    data: option("DIR", "INTERLINK_BUS_DATA", busDataDir, "folder for the queue database (one bus per folder)"),
    cap: option(
      "N",
      "INTERLINK_QUEUE_CAP",
      String(QUEUE_CAP),
      "messages one signer may have queued per recipient; past it the next is refused (429), none dropped",
    ),
    "opaque-cap": option(
      "N",
      "INTERLINK_BUS_OPAQUE_CAP",
      String(OPAQUE_CAP),
      "payloads that are not signed v2 messages held per recipient (apart from the cap; past it: 429)",
    ),
    "sender-mb": option(
      "MB",
      "INTERLINK_BUS_SENDER_MB",
      String(SENDER_BYTES_MAX >> 20),
      "MiB of messages one signer may have queued, all recipients together, each counting 256 bytes more (past it: 429)",
    ),
    "max-mb": option(
      "MB",
      "INTERLINK_BUS_MAX_MB",
      String(TOTAL_BYTES_MAX >> 20),
      "MiB of messages the bus holds in all (past it: 507)",
    ),
    owners: option(
      "N",
      "INTERLINK_BUS_OWNERS",
      String(OWNERS_MAX),
      "keys whose routes the bus protects (recipient ownership), never forgotten; past it the bus closes: every recv and ack then needs a proof, and reference nodes are refused (403)",
    ),
    guard: option("on|off", "INTERLINK_BUS_GUARD", "on", "ignored: every bus's server is bounded now"),
  },
  run: runBus,
};

// -- the public surface: what node tests, the bench and the board import

export { Bus, BusQueues, CONN_BODY_MS, CONN_IDLE_MS, errorResponse, jsonResponse, MESSAGE_OVERHEAD_BYTES };
export { NODE_ED25519, OPAQUE_CAP, RECV_BATCH_BYTES, RECV_TIMEOUT_MAX_MS, recvTimeoutMs, Roster };
export { ROSTER_PER_ADDRESS_CAP, ROUTE_OVERHEAD_BYTES, SENDER_BYTES_MAX, serveHttp, splitUrl, TOTAL_BYTES_MAX };
export type { Listening };

if (import.meta.main) runExtra("bus", command);
