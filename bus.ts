#!/usr/bin/env bun
/**
 * bus.ts: the relay. `interlink.ts bus` (or `bun bus.ts`) runs it: the durable keep-until-ack HTTP bus that nodes
 * talk through (SPEC "Bus HTTP API"). It is the one part of interlink that strangers reach, and it trusts none of
 * them: it holds no keys, verifies what it can (a v2 message's signature, an announcement's, an ownership proof) and
 * decides nothing for a node: the receiver's gate alone admits a message.
 *
 * What it defends: a 202 is never lost (on disk before it is answered); a key that proved it reads its routes here
 * is the only one to read or ack them; no sender, address or stranger takes more than its share of the queue, the
 * roster, the bytes in flight or the connections.
 * What it does not defend: confidentiality (it reads every payload it relays) and availability against its own
 * operator (it can drop or delay; it cannot forge).
 *
 * It imports interlink.ts (the node) for the wire: encoding, signing, the bounds both share. The node never imports
 * it: a session that starts a local bus runs `interlink.ts bus`, which loads this file.
 *
 * Sections, in dependency order (each uses only what stands above it):
 *   Constants · The bus · CLI
 */

import { Buffer } from "node:buffer";
import { spawnSync } from "node:child_process";
import * as fs from "node:fs";
import type * as net from "node:net";
import * as path from "node:path";
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
  DiskFullError,
  failpoint,
  field,
  fingerprint,
  FormatError,
  FRESH_FUTURE_MS,
  humanBytes,
  InterlinkError,
  intOption,
  isLoopback,
  isObject,
  JSON_VALUES_MAX,
  JsonlWriter,
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
  quarantineLine,
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
  scanLines,
  setAside,
  setLogComponent,
  shutdownSignal,
  type SignedMessage,
  timestamp,
  unregisterBytes,
  utf8Bytes,
  verifyAnnouncement,
  verifyDetached,
  verifyMessage,
  VERSION,
} from "./interlink.ts";

// ============================================================================
// Constants
// ============================================================================

/** Longest wait a client may ask for; past it proxies and NATs start cutting idle connections. */
const RECV_TIMEOUT_MAX_MS = 60_000;
/**
 * Per-recipient bound on payloads the bus cannot attribute to a signer (not v2 messages), refused past it like a full
 * route. Anyone can fill it; signed messages are never refused for it.
 */
const OPAQUE_CAP = 64;
/** Payload bytes one signer may have queued on a bus, all recipients together: one sender cannot fill it. */
const SENDER_BYTES_MAX = 8 << 20;
/**
 * Payload bytes a bus holds in all; past it, sends get 507. `bun bench.ts --only flood`: a Bun bus full of 900 KB
 * floods peaks near 4× this in memory, a Deno bus (--optimize-for-size) near 4.3×.
 */
const TOTAL_BYTES_MAX = 32 << 20;
/** A sessionless (0.4) announcement is served this long, as a 0.4 bus does: 0.4 clients read every entry as live. */
const ROSTER_SESSIONLESS_MS = 90_000;
/**
 * Roster entries from one source address (an IPv6 /64): one machine's sessions, or a small office behind one NAT.
 * Keys cost nothing, so this, not the per-key bound, keeps one host from filling a LAN bus's roster.
 */
const ROSTER_PER_ADDRESS_CAP = 256;
/** Against the bounds above, an entry counts one per this many bytes begun (a real one counts one): roster ≤ 4 MiB. */
const ROSTER_UNIT_BYTES = 1024;
/**
 * Sessions a bus remembers as ended by a signed unregister, so nobody re-posts their last announcement: far more than
 * end within ROSTER_RETENTION_MS on a real bus, a few MB. Past it the address that ended the most forgets its oldest.
 */
const ROSTER_ENDED_CAP = 8192;
/** ... and ended from one source address: past it that address's own oldest is forgotten, nobody else's. */
const ROSTER_ENDED_PER_ADDRESS_CAP = 512;
/**
 * Request body bytes a bus reads at once, in all: sixteen of the largest, far above what sessions send. Past it a
 * body is refused unread (503): stalled uploads cost at most this, however many they are.
 */
const BODIES_IN_FLIGHT_MAX = 32 << 20;
/** ... and from one source address (429): four of the largest at once; one host cannot take the whole budget. */
const BODIES_IN_FLIGHT_PER_ADDRESS = 8 << 20;
/**
 * An answer this large or larger is streamed and counted in flight. A smaller one is written whole: the kernel's
 * socket buffers take it at once (a receive window alone is this much), so a slow reader costs nothing.
 */
const ANSWER_STREAM_MIN_BYTES = 64 << 10;
/** Bytes of large answers not yet taken by their connections, in all (503 past it): sixteen of the largest message. */
const ANSWERS_IN_FLIGHT_MAX = 32 << 20;
/** ... and for one source address (429): four of the largest at once; one host cannot take the whole budget. */
const ANSWERS_IN_FLIGHT_PER_ADDRESS = 8 << 20;
/**
 * Payload bytes one batched recv answers at most (at least one message): half an address's answers in flight, so a
 * session's two long-polls (its route and its bare key) both fit.
 */
const RECV_BATCH_BYTES = 4 << 20;
/** Messages one batched recv answers at most (our extension: GET /recv?max=N), and acks one POST /ack takes. */
const RECV_BATCH_MAX = 64;
/** Longest recipient string the bus accepts: a 43-char key plus a label. */
const RECIPIENT_MAX_CHARS = 512;
/** Compact the bus queue file once dead records outnumber live ones and this floor. */
const COMPACT_MIN_DEAD = 10_000;
/** After a compaction fails (a full disk), wait this long before trying again rather than on every request. */
const COMPACT_RETRY_MS = 30_000;
/**
 * Room a bus leaves free on its disk (a sixteenth of a smaller disk): sends past it are refused (507), so its messages
 * never take the room a compaction needs once receivers have read them.
 */
const DISK_RESERVE_BYTES = 1 << 20;
/** On a disk that short of room, compact as soon as this much of the queue file is dead (and the new file fits). */
const DISK_RECLAIM_BYTES = 64 << 10;
/** How long a bus trusts its last look at the disk's free space (statfs), less what it wrote since. */
const DISK_LOOK_MS = 100;

// ============================================================================
// The bus
// ============================================================================
//
// A dumb relay (SPEC "Bus HTTP API"): it routes opaque JSON to a recipient string, holds no keys, and keeps each
// message until its recipient acks it. Its state is one JSONL file in the data folder:
//   {"t":"m","q":<recipient>,"n":<seq>,"ts":<ms>,"s":<sender>,"z":<bytes>,"p":<payload as JSON text>}  accepted
//   {"t":"a","q":<recipient>,"n":<seq>,…}                  acked: an "m" record marked in place (older buses appended these)
//   {"t":"d","q":<recipient>,"n":<seq>}                    dropped by the cap (earlier releases; read, not written)
//   {"t":"o","q":<key>}                                    the key has proven it owns its routes (an older bus: one a route)
//   {"t":"c","ts":<ms>}                                    closed: every route needs a proof from now on (see Bus.touchOwned)
//   {"t":"h","next":<seq>}                                 first line after compaction
// `seq` is global and never reused (compaction keeps the high-water mark), so an ack key names its message across a
// restart; but a message handed to a parked receiver before its record was written, lost with the process, leaves its
// seq to the next message, so an ack key names the ts too. Payloads stay JSON text end to end (the bus never parses
// what it relays) and live in the file, not in memory: a queued message is its offset there. "p" comes last, so a
// restart parses only each line's head (an older bus wrote "p" before "s": parsed whole, rewritten at the next
// compaction). Writes are group-committed: while an fdatasync runs, new messages wait in memory and go out as one
// write before the next (an ack writes what waits, then marks its record, before it is answered).

/** A queue file record (layout above); "m" is written by messageHead, read by MessageHeadReader. */
type BusRecord =
  /** `s` and `z` are absent before 0.5.0's layout. */
  | { t: "m"; q: string; n: number; ts: number; s?: string; z?: number; p: string }
  | { t: "a" | "d"; q: string; n: number }
  | { t: "o"; q: string }
  | { t: "c"; ts: number }
  | { t: "h"; next: number };

/** A queue line's record, or why it is not one (the line is then set aside). */
function decodeBusRecord(r: Record<string, unknown>): BusRecord | string {
  const seq = (v: unknown) => Number.isSafeInteger(v) && (v as number) > 0;
  const route = typeof r.q === "string" && r.q !== "" && r.q.length <= RECIPIENT_MAX_CHARS;
  const valid = r.t === "m"
    ? route && seq(r.n) && typeof r.p === "string" && Number.isSafeInteger(r.ts)
    : r.t === "a" || r.t === "d"
    ? route && seq(r.n)
    : r.t === "o"
    ? route
    : r.t === "c"
    ? Number.isSafeInteger(r.ts)
    : r.t === "h" && seq(r.next);
  if (!valid) return `not a valid "${String(r.t).slice(0, 8)}" record`;
  if (r.t !== "m") return r as BusRecord;
  return {
    ...r,
    s: typeof r.s === "string" ? r.s : undefined,
    z: Number.isSafeInteger(r.z) ? r.z : undefined,
  } as BusRecord;
}

interface Queued {
  seq: number;
  ts: number;
  /** The payload's JSON text until written; then read back from `at` (its literal's offset, `len` bytes). */
  payload: string | undefined;
  at: number;
  len: number;
  /** The verified signer of a v2 message; "" for an opaque payload. */
  sender: string;
  /** UTF-8 bytes of the payload: what the budgets count. */
  size: number;
  gone: boolean;
}

/** One recipient's FIFO in seq order: acked entries are marked, skipped, and trimmed off as the head advances. */
class RecipientQueue {
  items: Queued[] = [];
  head = 0;
  live = 0;
  /** Live messages per sender ("" for unattributed ones): whose cap a new message counts against. */
  bySender = new Map<string, number>(); // bounded: by the live messages

  firstN(n: number): Queued[] {
    const out: Queued[] = [];
    if (!this.first()) return out;
    for (let i = this.head; i < this.items.length && out.length < n; i++) {
      if (!this.items[i].gone) out.push(this.items[i]);
    }
    return out;
  }

  first(): Queued | undefined {
    while (this.head < this.items.length && this.items[this.head].gone) this.head++;
    if (this.head > 1024 && this.head * 2 > this.items.length) {
      this.items = this.items.slice(this.head);
      this.head = 0;
    }
    return this.items[this.head];
  }

  /** In seq order: a restored file may hold an entry after a later one. */
  insert(item: Queued): void {
    let at = this.items.length;
    while (at > this.head && this.items[at - 1].seq > item.seq) at--;
    if (at === this.items.length) this.items.push(item);
    else this.items.splice(at, 0, item);
  }

  /** Binary search: acks may name any entry, not only the head. */
  find(seq: number): Queued | undefined {
    let lo = this.head, hi = this.items.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      const item = this.items[mid];
      if (item.seq === seq) return item.gone ? undefined : item;
      if (item.seq < seq) lo = mid + 1;
      else hi = mid - 1;
    }
    return undefined;
  }

  /** `first` trims only the head: past twice the live entries (acks from the middle) the array is rebuilt. */
  remove(seq: number): Queued | undefined {
    const item = this.find(seq);
    if (!item) return undefined;
    item.gone = true;
    this.live--;
    if (this.items.length - this.head > 2 * this.live + 64) {
      this.items = this.items.filter((x) => !x.gone);
      this.head = 0;
    }
    const n = (this.bySender.get(item.sender) ?? 1) - 1;
    if (n) this.bySender.set(item.sender, n);
    else this.bySender.delete(item.sender);
    return item;
  }
}

interface QueueLimits {
  /** Verified messages one signer may have queued per recipient. */
  cap: number;
  /** Unattributed (opaque) messages per recipient. */
  opaqueCap: number;
  /** Bytes one verified sender may have queued in all (payloads plus MESSAGE_OVERHEAD_BYTES each). */
  senderBytes: number;
  /** Bytes in all, counted the same way, plus ROUTE_OVERHEAD_BYTES per route holding messages. */
  totalBytes: number;
}

/**
 * What a queued message costs beside its payload: its entry in memory (100 to 200 bytes, measured) and its record's
 * head on disk (about 150). So tiny payloads are bounded in count too: 32 MiB holds about 130,000.
 */
const MESSAGE_OVERHEAD_BYTES = 256;

/** ... and a route holding messages: its queue in memory (about 500 bytes with its name); 43,633 in 32 MiB. */
const ROUTE_OVERHEAD_BYTES = 512;

const DEFAULT_LIMITS: QueueLimits = {
  cap: QUEUE_CAP,
  opaqueCap: OPAQUE_CAP,
  senderBytes: SENDER_BYTES_MAX,
  totalBytes: TOTAL_BYTES_MAX,
};

/**
 * The bus's queue logic, no I/O: one FIFO per recipient, fair between senders. Nothing accepted is ever dropped: a
 * signer holding `cap` messages for a recipient is refused the next (`full`), so a flood costs only its sender. A
 * queue is deleted when it empties, so memory follows what is held.
 */
class BusQueues {
  #queues = new Map<string, RecipientQueue>(); // bounded: a route holds messages, each within the byte budgets
  /** Payload bytes and messages per verified sender, and one copy of its key string for every entry to share. */
  #senderBytes = new Map<string, { name: string; bytes: number; count: number }>(); // bounded: by the messages
  nextSeq = 1;
  liveCount = 0;
  bytes = 0;
  readonly limits: QueueLimits;

  constructor(limits: Partial<QueueLimits> | number = {}) {
    this.limits = { ...DEFAULT_LIMITS, ...(typeof limits === "number" ? { cap: limits } : limits) };
  }

  get recipientCount(): number {
    return this.#queues.size;
  }

  /** What the budget in all counts. */
  get charged(): number {
    return this.bytes + this.liveCount * MESSAGE_OVERHEAD_BYTES + this.#queues.size * ROUTE_OVERHEAD_BYTES;
  }

  /** Why a payload of `size` bytes from `sender` to `to` ("": not known yet) cannot be taken now, or null. */
  admit(sender: string, size: number, to = ""): "global" | "sender" | null {
    const cost = size + MESSAGE_OVERHEAD_BYTES;
    const route = this.#queues.has(to) ? 0 : ROUTE_OVERHEAD_BYTES;
    if (this.charged + cost + route > this.limits.totalBytes) return "global";
    const held = sender ? this.#senderBytes.get(sender) : undefined;
    const charged = held ? held.bytes + held.count * MESSAGE_OVERHEAD_BYTES : 0;
    if (sender && charged + cost > this.limits.senderBytes) return "sender";
    return null;
  }

  /** Whatever the caps: `full` is asked first, and a restart files all it accepted, past a lowered cap too. */
  add(
    to: string,
    ts: number,
    payload: string | undefined,
    seq = this.nextSeq,
    sender = "",
    size = utf8Bytes(payload!),
  ): Queued {
    let q = this.#queues.get(to);
    if (!q) this.#queues.set(to, q = new RecipientQueue());
    let held = sender ? this.#senderBytes.get(sender) : undefined;
    if (sender && !held) this.#senderBytes.set(sender, held = { name: sender, bytes: 0, count: 0 });
    if (held) {
      sender = held.name;
      held.bytes += size;
      held.count++;
    }
    this.bytes += size;
    const item: Queued = { seq, ts, payload, at: -1, len: 0, sender, size, gone: false };
    q.insert(item);
    q.live++;
    q.bySender.set(sender, (q.bySender.get(sender) ?? 0) + 1);
    this.liveCount++;
    if (seq >= this.nextSeq) this.nextSeq = seq + 1;
    return item;
  }

  /** How many `sender` ("" unattributed) holds for `to` once that reaches its cap (the next is refused), else null. */
  full(to: string, sender: string): number | null {
    const held = this.#queues.get(to)?.bySender.get(sender) ?? 0;
    return held >= (sender === "" ? this.limits.opaqueCap : this.limits.cap) ? held : null;
  }

  firstN(to: string, n: number): Queued[] {
    return this.#queues.get(to)?.firstN(n) ?? [];
  }

  first(to: string): Queued | undefined {
    return this.#queues.get(to)?.first();
  }

  get(to: string, seq: number): Queued | undefined {
    return this.#queues.get(to)?.find(seq);
  }

  has(to: string, seq: number): boolean {
    return this.get(to, seq) !== undefined;
  }

  /** Entries `to` keeps in memory, removed ones not yet let go included: at most about twice the live ones. */
  footprint(to: string): number {
    const q = this.#queues.get(to);
    return q ? q.items.length - q.head : 0;
  }

  remove(to: string, seq: number): boolean {
    const q = this.#queues.get(to);
    const item = q?.remove(seq);
    if (!item) return false;
    this.liveCount--;
    this.bytes -= item.size;
    const held = item.sender ? this.#senderBytes.get(item.sender) : undefined;
    if (held) (held.bytes -= item.size, --held.count || this.#senderBytes.delete(item.sender));
    if (q!.live === 0) this.#queues.delete(to);
    return true;
  }

  /** Every live message, per recipient in seq order (what compaction keeps). */
  *live(): Generator<[string, Queued]> {
    for (const [to, q] of this.#queues) {
      for (let i = q.head; i < q.items.length; i++) if (!q.items[i].gone) yield [to, q.items[i]];
    }
  }
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

/** Why a roster refused an announcement: a newer one is filed, its session ended after it was signed, or a bound. */
type RosterRefusal = "older" | "ended" | "full" | "address" | "key";

/**
 * Presence on the bus: verified announcements keyed `pubkey#session_id` (the bare key when sessionless), kept
 * ROSTER_RETENTION_MS (sessionless: ROSTER_SESSIONLESS_MS), bounded in units (ROSTER_UNIT_BYTES) in all, per key and
 * per source address. Keys cost nothing, so a flood never pushes out a live session: past its key's bound, that key's
 * sessions signed before the newcomer go, earliest first; past the address's or the roster's, only entries away
 * PRESENCE_LIVE_MS or more, stalest first, else the newcomer is refused. A refresh keeps its place, past the roster's
 * bound too. A session its key unregistered is not listed again from an older announcement (see end). The map is in
 * refresh order.
 */
class Roster {
  #entries = new Map<string, RosterEntry>(); // bounded: `cap` units, each entry at least one
  #perKey = new Map<string, number>(); // units: bounded by the entries
  #perAddress = new Map<string, number>(); // units per address bucket: bounded by the entries
  #units = 0;
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

  get units(): number {
    return this.#units;
  }

  /** Files an announcement posted from address bucket `from`: true, or why not. */
  put(a: Announcement, json: string, nowMs: number, from = ""): true | RosterRefusal {
    const id = rosterKey(a);
    const ended = this.#ended.get(id);
    if (ended && a.ts <= ended.ts) return "ended";
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
    // Entries that give way, and the units they free where this one counts.
    const going: string[] = [];
    const freed = { all: 0, key: 0, address: 0 };
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
      all: () => this.#units - freed.all + units > this.cap,
    };
    /** Drops entries `which` allows, stalest first, until `bound` is met; false if it cannot be. */
    const makeRoom = (bound: () => boolean, which: (e: RosterEntry) => boolean, liveToo = false): boolean => {
      for (const [k, e] of this.#entries) {
        if (!bound()) return true;
        if (!liveToo && nowMs - e.at < PRESENCE_LIVE_MS) return false; // refresh order: the rest are live too
        if (k !== id && which(e)) drop(k, e);
      }
      return !bound();
    };
    // By signed time, not refresh order: anyone can post a key's earlier announcements again, none sign a later one.
    if (over.key()) {
      const earlier = [...this.#entries].filter(([k, e]) => k !== id && e.pubkey === a.pubkey && e.ts <= a.ts);
      for (const [k, e] of earlier.sort(([, x], [, y]) => x.ts - y.ts)) {
        if (!over.key()) break;
        drop(k, e);
      }
      if (over.key()) return "key";
    }
    if (!makeRoom(over.address, (e) => e.from === from)) return "address";
    if (!old && !makeRoom(over.all, () => true)) return "full";
    for (const k of going) this.#remove(k);
    const sessionless = !a.session?.session_id;
    this.#entries.set(id, { json, at: nowMs, ts: a.ts, pubkey: a.pubkey, sessionless, from, units });
    this.#perKey.set(a.pubkey, (this.#perKey.get(a.pubkey) ?? 0) + units);
    this.#perAddress.set(from, (this.#perAddress.get(from) ?? 0) + units);
    this.#units += units;
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
    let mine = this.#endedBy.get(from);
    if (mine && mine.size >= this.endedPerAddressCap) this.#forgetEnded(mine.values().next().value!);
    else if (this.#ended.size >= this.endedCap) {
      let most: Set<string> | undefined;
      for (const ids of this.#endedBy.values()) if (!most || ids.size > most.size) most = ids;
      this.#forgetEnded(most!.values().next().value!);
    }
    this.#ended.set(key, { ts, from });
    mine = this.#endedBy.get(from);
    if (!mine) this.#endedBy.set(from, mine = new Set());
    mine.add(key);
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
    this.#units -= e.units;
    const less = (m: Map<string, number>, k: string) => {
      const n = (m.get(k) ?? e.units) - e.units;
      if (n > 0) m.set(k, n);
      else m.delete(k);
    };
    less(this.#perKey, e.pubkey);
    less(this.#perAddress, e.from);
  }

  /** At least the bytes of GET /roster's answer: each entry's units of ROSTER_UNIT_BYTES, plus its `age_ms`. */
  answerBytes(): number {
    return 16 + this.#units * ROSTER_UNIT_BYTES + this.#entries.size * 32;
  }

  /** GET /roster's entries, each with an unsigned `age_ms`; expired ones are pruned. */
  list(nowMs: number): string[] {
    const out: string[] = [];
    for (const [key, e] of this.#entries) {
      const age = nowMs - e.at;
      if (age >= (e.sessionless ? ROSTER_SESSIONLESS_MS : ROSTER_RETENTION_MS)) {
        this.#remove(key);
        continue;
      }
      out.push(`${e.json.slice(0, -1)}${e.json.length > 2 ? "," : ""}"age_ms":${age}}`);
    }
    return out;
  }
}

class HttpError extends Error {
  /** `close`: the body was left unread (refused on its length, cut off), so the answer ends the connection. */
  constructor(readonly status: number, message: string, readonly close = false) {
    super(message);
  }
}

/**
 * The source a per-address budget counts against: an IPv4 address; the /64 of an IPv6 one (what one host usually
 * holds: else a host had 2^64 budgets); all of 127.0.0.0/8 as one (any local user may connect from all of it). ""
 * for a request not over a socket. A bus behind a proxy sees every client as the proxy.
 */
function addressBucket(address: string): string {
  const v4 = /^(?:::ffff:)?(\d{1,3}(?:\.\d{1,3}){3})$/i.exec(address);
  if (v4) return v4[1].startsWith("127.") ? "127.0.0.0/8" : v4[1];
  if (!address.includes(":")) return address;
  const [left, right] = address.split("%")[0].split("::");
  const head = left ? left.split(":") : [];
  const tail = right === undefined ? [] : right ? right.split(":") : [];
  const groups = right === undefined
    ? head
    : [...head, ...Array(Math.max(0, 8 - head.length - tail.length)).fill("0"), ...tail];
  return `${groups.slice(0, 4).map((g) => (parseInt(g, 16) || 0).toString(16)).join(":")}::/64`;
}

/**
 * Bytes in flight through the bus's HTTP server, in all and per source address: request bodies being read (the
 * declared length reserved before a byte is read, a chunked body chunk by chunk, given back once the runtime lets go
 * of it), or large answers being written (reserved before their payloads are read, given back at the last byte, a
 * close or the deadline). Past either budget a request is refused: a thousand connections stalled on 2 MiB each hold
 * the budget, not 2 GB.
 */
class BytesInFlight {
  bytes = 0;
  #byAddress = new Map<string, number>(); // bounded: an entry lives only while its address has bytes in flight

  /** `what`: the bytes counted, as refusals name them; `close`: a refusal ends the connection (a body left unread). */
  constructor(
    readonly max = BODIES_IN_FLIGHT_MAX,
    readonly perAddress = BODIES_IN_FLIGHT_PER_ADDRESS,
    readonly what = "request bodies being read",
    readonly close = true,
  ) {}

  take(from: string, n: number): void {
    if (n <= 0) return;
    const mine = this.#byAddress.get(from) ?? 0;
    const refuse = (status: number, who: string, held: number, max: number, all = "") =>
      new HttpError(
        status,
        `${who} already has ${humanBytes(held)} of ${this.what}${all} (at most ${
          humanBytes(max)
        } at once); retry in a moment`,
        this.close,
      );
    if (mine + n > this.perAddress) throw refuse(429, "your address", mine, this.perAddress);
    if (this.bytes + n > this.max) throw refuse(503, "this bus", this.bytes, this.max, " in all");
    this.#byAddress.set(from, mine + n);
    this.bytes += n;
  }

  give(from: string, n: number): void {
    if (n <= 0) return;
    this.bytes -= n;
    const left = (this.#byAddress.get(from) ?? n) - n;
    if (left > 0) this.#byAddress.set(from, left);
    else this.#byAddress.delete(from);
  }
}

/** The budget a request's bytes in flight count against, and its address bucket. */
interface InFlightBudget {
  inFlight: BytesInFlight;
  from: string;
}

/** What one answer holds of the answers' BytesInFlight until `release` (idempotent); `writeMs`: see streamedAnswer. */
class AnswerHold {
  bytes = 0;
  constructor(readonly budget: InFlightBudget, readonly writeMs = ANSWER_WRITE_MS) {}

  /** Holds `n` bytes in place of what it held, or throws the 429 or 503; nothing below ANSWER_STREAM_MIN_BYTES. */
  hold(n: number): void {
    this.release();
    if (n < ANSWER_STREAM_MIN_BYTES) return;
    this.budget.inFlight.take(this.budget.from, n);
    this.bytes = n;
  }

  release(): void {
    this.budget.inFlight.give(this.budget.from, this.bytes);
    this.bytes = 0;
  }
}

let httpDate = { second: 0, text: "" };

/** The Date header, formatted once a second rather than once per answer. */
function currentHttpDate(): string {
  const second = Math.floor(Date.now() / 1000);
  if (second !== httpDate.second) httpDate = { second, text: new Date(second * 1000).toUTCString() };
  return httpDate.text;
}

/** Every answer carries Date (Bun's server does not add it): `doctor` measures clock skew against it. */
const jsonResponse = (status: number, body: string, headers: Record<string, string> = {}): Response =>
  new Response(body, { status, headers: { "content-type": "application/json", date: currentHttpDate(), ...headers } });

const errorResponse = (status: number, message: string): Response =>
  jsonResponse(status, JSON.stringify({ error: message }));

/** A large answer's slice handed to the runtime at a time: what a connection's slow reader keeps in the bus's memory. */
const ANSWER_CHUNK_BYTES = 64 << 10;

/** Answers made by streamedAnswer: the guarded server writes them with backpressure rather than whole. */
const STREAMED_ANSWERS = new WeakSet<Response>(); // weak: gone with its answer

/**
 * A JSON answer of `text`: whole when short; else a pull stream of slices, each made once the connection took the one
 * before (Bun, Deno.serve and the guarded server all wait for the socket), its bytes counted in `held` until the last
 * slice, a close (cancel), or ANSWER_WRITE_MS after it was made (the stream fails, the connection closes): a reader
 * that never reads holds its share that long, never memory for good.
 */
function streamedAnswer(status: number, text: string, held?: AnswerHold): Response {
  if (!held?.bytes && text.length < ANSWER_STREAM_MIN_BYTES / 3) return jsonResponse(status, text); // 3 bytes a char at most
  const bytes = Buffer.from(text);
  if (!held?.bytes && bytes.length < ANSWER_STREAM_MIN_BYTES) return jsonResponse(status, text);
  let at = 0;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const done = () => {
    clearTimeout(timer);
    held?.release();
  };
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      const ms = held?.writeMs ?? ANSWER_WRITE_MS;
      timer = setTimeout(() => {
        done();
        c.error(new Error(`the answer was not all read ${ms / 1000} s after it was made`));
      }, ms);
    },
    pull(c) {
      c.enqueue(bytes.subarray(at, at += ANSWER_CHUNK_BYTES));
      if (at >= bytes.length) (c.close(), done());
    },
    cancel: done,
  }, { highWaterMark: 0 });
  const r = new Response(body, { status, headers: { "content-type": "application/json", date: currentHttpDate() } });
  STREAMED_ANSWERS.add(r);
  return r;
}

/**
 * Reads a JSON body of at most BODY_LIMIT_BYTES, counted as it arrives (Content-Length may be absent or lie), within
 * CONN_BODY_MS (a drip gets 408), against `budget`: reserved before reading, held until the runtime's read ends.
 */
async function readJsonBody(req: Request, budget?: InFlightBudget, maxValues = JSON_VALUES_MAX): Promise<unknown> {
  const declared = declaredLength(req);
  if (declared !== null && declared > BODY_LIMIT_BYTES) {
    throw new HttpError(413, `body over ${BODY_LIMIT_BYTES} bytes`, true);
  }
  let reserved = 0;
  const reserve = (n: number) => {
    budget?.inFlight.take(budget.from, n);
    reserved += n;
  };
  let reading: Promise<unknown> = Promise.resolve(); // the runtime's read: the reservation lasts as long
  let timer: ReturnType<typeof setTimeout> | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () => reject(new HttpError(408, `the body was not all there ${CONN_BODY_MS / 1000} s after its headers`, true)),
      CONN_BODY_MS,
    );
  });
  let text: string;
  try {
    if (declared !== null) {
      reserve(declared);
      // The server holds the body to its declared length. (Not touching req.body keeps Deno on its fast path.)
      const whole = req.text();
      reading = whole;
      text = await Promise.race([whole, deadline]);
      if (text === "") throw new HttpError(400, "empty body; expected JSON");
    } else {
      if (!req.body) throw new HttpError(400, "empty body; expected JSON");
      const reader = req.body.getReader();
      const chunks: Uint8Array[] = [];
      let size = 0;
      try {
        for (;;) {
          const { done, value } = await Promise.race([reader.read(), deadline]);
          if (done) break;
          size += value.length;
          if (size > BODY_LIMIT_BYTES) throw new HttpError(413, `body over ${BODY_LIMIT_BYTES} bytes`, true);
          reserve(value.length);
          chunks.push(value);
        }
      } catch (e) {
        reading = reader.cancel().catch(() => {});
        throw e;
      }
      text = Buffer.concat(chunks).toString("utf8");
    }
  } catch (e) {
    if (e instanceof HttpError) throw e;
    // A malformed chunked encoding, a body cut off: the request's fault, never a 500.
    throw new HttpError(400, `the body could not be read (${(e as Error).message})`, true);
  } finally {
    clearTimeout(timer);
    if (reserved) {
      const give = () => budget!.inFlight.give(budget!.from, reserved);
      reading.then(give, give);
    }
  }
  const { depth, values } = jsonShape(text);
  if (depth > JSON_DEPTH_MAX) throw new HttpError(400, `body nests deeper than ${JSON_DEPTH_MAX} levels`);
  if (values > maxValues) {
    throw new HttpError(
      400,
      `body holds more than ${maxValues} JSON values (objects, arrays and members; a message holds about 15)`,
    );
  }
  try {
    return JSON.parse(text);
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

/** Deepest JSON nesting a request may have: a signed message nests 2 levels, an announcement 3. */
const JSON_DEPTH_MAX = 64;

/** An unregister is honoured only this long after it was signed (a captured one cannot be replayed later). */
const UNREGISTER_FRESH_MS = 5 * 60_000;

/** Defaults: QueueLimits' constants, OWNERS_MAX, ANSWERS_IN_FLIGHT_*, ANSWER_WRITE_MS, COMPACT_MIN_DEAD, diskReserve. */
interface BusOptions {
  cap?: number;
  limits?: Partial<QueueLimits>;
  owners?: number;
  answers?: { max?: number; perAddress?: number; writeMs?: number };
  diskReserve?: number;
  compactMinDead?: number;
  log?: (msg: string) => void;
  now?: () => number;
}

/** A record waiting for the next write; a message's also has its route, head and literal bytes, and its entry. */
interface PendingLine {
  text: string;
  bytes: number;
  to?: string;
  head?: number;
  len?: number;
  item?: Queued;
  /** Where the literal landed, once written. */
  at?: number;
  /** Why its write failed: the send that waits on it answers with that, whatever the fsync says. */
  failed?: unknown;
}

/** An ack in place writes this over a message record's tag (see Bus.ack): `{"t":"m"` becomes `{"t":"a"`. */
const ACKED_TAG = Buffer.from("a");

const ACKED_TAG_AT = '{"t":"'.length;

/** The start of an "m" record, up to `"p":`; the payload as a JSON string literal and `}\n` complete it. */
const messageHead = (q: string, n: number, ts: number, s: string, z: number): string =>
  `{"t":"m","q":${JSON.stringify(q)},"n":${n},"ts":${ts},"s":${JSON.stringify(s)},"z":${z},"p":`;

/**
 * Reads the head of an "m" record in today's layout from the bytes (a restart reads 300k: no JSON.parse); false for
 * any other layout (an older bus, escapes in a name), which the caller parses as JSON. `t` "a": acked in place; `p`:
 * where the payload literal starts. A name read before comes back as the same string: one copy per name.
 */
class MessageHeadReader {
  t: "m" | "a" = "m";
  q = "";
  n = 0;
  ts = 0;
  s = "";
  z = 0;
  p = 0;
  #buf: Uint8Array = new Uint8Array(0);
  #i = 0;
  #end = 0;
  #names = new Map<number, { bytes: Uint8Array; text: string }>(); // by a hash of the bytes

  read(buf: Buffer, start: number, end: number): boolean {
    this.#buf = buf;
    this.#i = start;
    this.#end = end;
    if (end - start < 40 || buf[end - 1] !== 0x7d || buf[end - 2] !== 0x22) return false;
    let name: string | null;
    if (!this.#literal('{"t":"')) return false;
    const tag = buf[this.#i++];
    if (tag !== 0x6d && tag !== 0x61) return false; // "m", or "a": acked in place
    this.t = tag === 0x6d ? "m" : "a";
    if (!this.#literal('","q":"') || (name = this.#string()) === null) return false;
    this.q = name;
    if (!this.#literal(',"n":') || (this.n = this.#int()) <= 0) return false;
    if (!this.#literal(',"ts":') || (this.ts = this.#int()) < 0) return false;
    if (!this.#literal(',"s":"') || (name = this.#string()) === null) return false;
    this.s = name;
    if (!this.#literal(',"z":') || (this.z = this.#int()) < 0) return false;
    if (!this.#literal(',"p":"')) return false;
    this.p = this.#i - 1;
    return true;
  }

  #literal(text: string): boolean {
    const buf = this.#buf, i = this.#i;
    for (let k = 0; k < text.length; k++) if (buf[i + k] !== text.charCodeAt(k)) return false;
    this.#i += text.length;
    return true;
  }

  /** Decimal digits (at most 15): their value, or -1. */
  #int(): number {
    const buf = this.#buf, from = this.#i;
    let v = 0, i = from;
    for (let c = buf[i]; c >= 48 && c <= 57 && i - from < 15; c = buf[++i]) v = v * 10 + c - 48;
    this.#i = i;
    return i > from ? v : -1;
  }

  /** After an opening quote, up to the closing one; null if an escape comes first. */
  #string(): string | null {
    const buf = this.#buf, from = this.#i;
    let i = from, hash = 0x811c9dc5;
    for (let c = buf[i]; c !== 0x22; c = buf[++i]) {
      if (c === 0x5c || i >= this.#end) return null;
      hash = Math.imul(hash ^ c, 16777619);
    }
    this.#i = i + 1;
    const known = this.#names.get(hash);
    if (known && known.bytes.length === i - from) {
      let k = 0;
      while (k < known.bytes.length && known.bytes[k] === buf[from + k]) k++;
      if (k === known.bytes.length) return known.text;
    }
    const text = Buffer.from(buf.buffer, buf.byteOffset + from, i - from).toString("utf8");
    // A copy: `buf` is the scan's reused chunk. (Buffer's slice would be a view.)
    if (this.#names.size < 10_000) this.#names.set(hash, { bytes: new Uint8Array(buf.subarray(from, i)), text });
    return text;
  }
}

interface BusDelivery {
  seq: number;
  ts: number;
  payload: string;
}

/** The durable bus: BusQueues and Roster behind a Request → Response handler, on one JSONL file. */
class Bus {
  readonly roster = new Roster();
  readonly inFlight = new BytesInFlight();
  readonly answers: BytesInFlight;
  #waiters = new Map<string, Set<() => void>>(); // bounded: by the open long-polls
  #syncTimer: ReturnType<typeof setTimeout> | null = null; // the lazy fsync of acks, once scheduled
  #compactAfter = 0; // after a failed compaction, the time of the next try
  #pending: PendingLine[] = []; // records made while an fdatasync runs: the next round writes them as one
  #reader: number; // the queue file: payloads are read back through it, acks mark records in place
  #readBuf = Buffer.allocUnsafe(64 * 1024);
  /** Keys that proved they read their routes here (see checkOwnership), as "o" records, never forgotten. */
  readonly #owners = new Set<string>(); // bounded: ownersMax, past it the bus closes (see #close)
  #ownerBytes = 0; // their records' bytes, and the "c" record's: what a compaction writes for them
  /** When the bus closed (its "c" record), or null while it serves the routes of keys that never proved. */
  #closedSince: number | null = null;
  /** Route → the last proof whose signature verified, so a repeat skips the check (never the freshness one). */
  readonly #verified = new BoundedMap<string, string>(PROOFS_REMEMBERED); // bounded: forgetting costs one check
  readonly ownersMax: number;
  /** The data folder's disk as last looked at: free bytes (less what was written since), size, when. */
  #disk = { free: Infinity, size: Infinity, at: -Infinity };
  #deadBytes = 0; // bytes of the queue file that no longer hold a live record: what a compaction gives back
  readonly #log: (msg: string) => void;
  readonly now: () => number;
  /** A copy of open's options: a caller changing its object afterwards changes no limit. */
  private readonly opts: BusOptions;

  private constructor(
    readonly dataDir: string,
    readonly queues: BusQueues,
    readonly recovery: RecoveryReport,
    private writer: JsonlWriter,
    private lock: PidLock,
    private dead: number, // records in the file that no longer describe a live message
    opts: BusOptions,
  ) {
    this.opts = { ...opts, answers: { ...opts.answers } };
    this.#log = opts.log ?? logInfo;
    this.now = opts.now ?? Date.now;
    this.ownersMax = opts.owners ?? OWNERS_MAX;
    this.answers = new BytesInFlight(
      opts.answers?.max ?? ANSWERS_IN_FLIGHT_MAX,
      opts.answers?.perAddress ?? ANSWERS_IN_FLIGHT_PER_ADDRESS,
      "answers not yet taken by their connections",
      false,
    );
    this.#reader = fs.openSync(writer.file, "r+");
    // A held batch that cannot be written fails its own lines (each send checks its line), not the round.
    writer.beforeSync = () => {
      try {
        this.#flush();
      } catch (e) {
        this.#log(`cannot write the queue file: ${(e as Error).message}; the sends held for it are refused`);
      }
    };
  }

  /**
   * Locks the data folder, replays the queue file and compacts it if mostly dead (or in an older layout). A line that
   * is not a valid record is quarantined alone, never blocking a recipient; a torn last line is set aside and cut off.
   */
  static async open(dataDir: string, opts: BusOptions = {}): Promise<Bus> {
    fs.mkdirSync(dataDir, { recursive: true, mode: 0o700 });
    const lock = await PidLock.acquire(path.join(dataDir, "bus.lock"), "interlink bus");
    try {
      const file = path.join(dataDir, "queue.jsonl");
      // A compaction killed midway leaves its temp file, named by its pid: only the bus holding the lock writes here.
      for (const name of fs.readdirSync(dataDir)) {
        if (/^queue\.jsonl\.\d+\.tmp$/.test(name)) fs.rmSync(path.join(dataDir, name), { force: true });
      }
      const started = performance.now();
      const queues = new BusQueues({ ...opts.limits, ...(opts.cap ? { cap: opts.cap } : {}) });
      const bad: [offset: number, bytes: number, reason: string, line: string][] = [];
      const owners = new Set<string>(); // keys that proved they own their routes before the restart
      let closedSince: number | null = null;
      let records = 0, inMemory = 0;
      const h = new MessageHeadReader();
      /** A message record in today's layout, read from its head alone: the payload stays on disk. */
      const fastMessage = (buf: Buffer, start: number, end: number, at: number): boolean => {
        // A size above the literal's length is damage (escapes only lengthen): the plain JSON path judges it.
        if (!h.read(buf, start, end) || !h.q || h.q.length > RECIPIENT_MAX_CHARS || h.z > end - 1 - h.p) return false;
        if (h.t === "a") { // acked in place: a dead record, whose seq stays used
          queues.nextSeq = Math.max(queues.nextSeq, h.n + 1);
          return true;
        }
        const item = queues.add(h.q, h.ts, undefined, h.n, h.s, h.z);
        item.at = at + h.p - start;
        item.len = end - 1 - h.p;
        return true;
      };
      const { next, tornBytes } = scanLines(file, 0, (buf, start, end, at) => {
        if (fastMessage(buf, start, end, at)) return void records++;
        const line = buf.toString("utf8", start, end);
        if (line.trim() === "") return;
        let r: Record<string, unknown>;
        try {
          r = JSON.parse(line);
        } catch (e) {
          return void bad.push([at, end - start, `not JSON (${(e as Error).message})`, line]);
        }
        if (!isObject(r) || typeof r.t !== "string") {
          return void bad.push([at, end - start, "not a tagged record", line]);
        }
        const rec = decodeBusRecord(r);
        if (typeof rec === "string") return void bad.push([at, end - start, rec, line]);
        records++;
        switch (rec.t) {
          case "h":
            queues.nextSeq = Math.max(queues.nextSeq, rec.next);
            break;
          case "m":
            // A record before 0.5.0 names no sender: its payload's claim is taken, for fairness only.
            queues.add(rec.q, rec.ts, rec.p, rec.n, rec.s ?? claimedSender(rec.p));
            if (rec.z === undefined) inMemory++; // an older layout is rewritten at open
            break;
          case "a":
          case "d":
            queues.remove(rec.q, rec.n);
            queues.nextSeq = Math.max(queues.nextSeq, rec.n + 1); // an "a" may be its message's record, acked in place
            break;
          case "o":
            owners.add(parseRoute(rec.q).key); // an older bus wrote one per route
            break;
          case "c":
            closedSince = Math.min(closedSince ?? rec.ts, rec.ts);
        }
      });
      for (const [at, bytes, why, line] of bad) quarantineLine(file, at, bytes, why, line);
      if (tornBytes) {
        const tail = Buffer.alloc(tornBytes);
        const fd = fs.openSync(file, "r");
        try {
          fs.readSync(fd, tail, 0, tornBytes, next);
        } finally {
          fs.closeSync(fd);
        }
        setAside(file, next, "torn last line", tail.toString());
        fs.truncateSync(file, next);
      }
      const recovery = {
        messages: queues.liveCount,
        recipients: queues.recipientCount,
        skippedLines: bad.length + (tornBytes ? 1 : 0),
        ms: Math.round(performance.now() - started),
      };
      const writer = new JsonlWriter(file, `the bus data folder ${dataDir}`);
      const kept = queues.liveCount + owners.size + (closedSince === null ? 0 : 1); // what a compaction writes
      const bus = new Bus(dataDir, queues, recovery, writer, lock, records - kept, opts);
      for (const key of owners) bus.#addOwner(key);
      if (closedSince !== null) bus.#setClosed(closedSince);
      bus.#deadBytes = Math.max(0, fs.statSync(file).size - bus.#ownerBytes - queues.charged);
      bus.#maybeCompact(true, inMemory > 0);
      return bus;
    } catch (e) {
      lock.release();
      throw e;
    }
  }

  /** Writes made to the queue file and fsync rounds run (for tests). */
  get writeStats(): { writes: number; rounds: number } {
    return this.writer.stats;
  }

  /** Open long-polls right now (for tests). */
  get waiterCount(): number {
    let n = 0;
    for (const set of this.#waiters.values()) n += set.size;
    return n;
  }

  /** `from`: the address the request came from (serveHttp says), for the per-address budgets; "" when unknown. */
  readonly handler = async (req: Request, from = ""): Promise<Response> => {
    const { pathname, query } = splitUrl(req.url);
    const route = BUS_ROUTES[pathname];
    if (!route) {
      return errorResponse(404, `no route ${pathname}; the bus serves ${Object.keys(BUS_ROUTES).join(", ")}`);
    }
    if (req.method !== route.method) {
      return jsonResponse(405, JSON.stringify({ error: `${pathname} takes ${route.method}` }), { allow: route.method });
    }
    try {
      const r = await route.handle(this, req, { query, from: addressBucket(from) });
      // A reference bus sends no such header: our client batches only where it sees one; doctor reports it.
      r.headers.set("interlink-bus", BUS_FEATURES);
      return r;
    } catch (e) {
      if (e instanceof HttpError) {
        // A body left unread must not keep its connection (Bun then closes it; node:http does on its own).
        return jsonResponse(e.status, JSON.stringify({ error: e.message }), e.close ? { connection: "close" } : {});
      }
      if (req.signal.aborted) return errorResponse(499, "client closed the request"); // a hang-up: not an error here
      this.#log(`internal error on ${pathname}: ${(e as Error).stack ?? e}`);
      return errorResponse(500, "internal error; see the bus log");
    }
  };

  /**
   * Throws the 507 or 429 a message of `size` bytes from `sender` ("" when unknown) to `to` ("": not known yet)
   * would get: the byte budgets, then the room kept free on the disk. `close`: the body is unread (see HttpError).
   */
  ensureRoom(sender: string, size: number, to = "", close = false): void {
    const over = this.queues.admit(sender, size, to);
    if (over) {
      const counted = `payloads, ${MESSAGE_OVERHEAD_BYTES} bytes a message and ${ROUTE_OVERHEAD_BYTES} a route`;
      const all = humanBytes(this.queues.limits.totalBytes), mine = humanBytes(this.queues.limits.senderBytes);
      throw over === "global"
        ? new HttpError(507, `this bus holds its whole budget of ${all} of messages (${counted}); retry later`, close)
        : new HttpError(
          429,
          `this sender already has ${mine} queued on this bus (${counted}); retry once some is read`,
          close,
        );
    }
    this.#ensureDisk(2 * size + MESSAGE_OVERHEAD_BYTES, close); // a record: at most twice the payload (escapes), and its head
  }

  /** Free bytes on the data folder's disk: looked up (statfs) at most every DISK_LOOK_MS, or `now`, less writes since. */
  #diskFree(now = false): number {
    const t = performance.now();
    if (now || t - this.#disk.at >= DISK_LOOK_MS) {
      try {
        const st = fs.statfsSync(this.dataDir);
        this.#disk = { free: st.bavail * st.bsize, size: st.blocks * st.bsize, at: t };
      } catch {
        this.#disk = { free: Infinity, size: Infinity, at: t }; // cannot tell: a write that fails says so
      }
    }
    return this.#disk.free;
  }

  /** Room kept free for what must always be written (compactions, the odd small record; acks need none). */
  diskReserve(): number {
    return (this.opts.diskReserve ?? Math.min(DISK_RESERVE_BYTES, Math.floor(this.#disk.size / 16))) + this.#ownerBytes;
  }

  /** Throws the 507 for a write of `bytes` that would eat into the reserve (looked at afresh before refusing). */
  #ensureDisk(bytes: number, close = false): void {
    if (this.#diskFree() - bytes >= this.diskReserve()) return;
    const free = this.#diskFree(true);
    if (free - bytes >= this.diskReserve()) return;
    const left = humanBytes(Math.max(0, free));
    throw new HttpError(
      507,
      `the disk of the bus's data folder is full: ${left} free, which the bus keeps for compacting its queue file; nothing was stored; retry once receivers have read their mail`,
      close,
    );
  }

  /** Throws the 429 for one more message from `sender` to `to` past its cap: nothing accepted makes room (QUEUE_CAP). */
  ensureRouteRoom(to: string, sender: string): void {
    const held = this.queues.full(to, sender);
    if (held === null) return;
    const route = `${fingerprint(to)}${to.includes("#") ? to.slice(to.indexOf("#")) : ""}`;
    const what = sender ? "messages from this sender" : "unattributed payloads";
    throw new HttpError(
      429,
      `${ROUTE_FULL}: ${route} holds ${held} ${what} not yet read, as many as this bus keeps; nothing was queued, and nothing queued before was dropped; retry once the recipient reads some`,
    );
  }

  /**
   * Queues a message; resolves once it is on stable storage (the 202). It enters memory in the same step as its record
   * enters the write path, so a compaction meanwhile carries it. A parked receiver may get it before the fsync; a crash
   * then loses it only if its record was still held, and its sender, never answered 202, sends it again: at worst a
   * redelivery, which replay memory drops. A failed write leaves nothing in memory and is a 507.
   */
  async send(to: string, payload: string, sender = ""): Promise<void> {
    const size = utf8Bytes(payload);
    this.ensureRoom(sender, size, to);
    this.ensureRouteRoom(to, sender);
    const seq = this.queues.nextSeq++; // used up even if the write fails: a fenced record can never share it
    const ts = this.now();
    const head = messageHead(to, seq, ts, sender, size);
    const literal = JSON.stringify(payload);
    const headBytes = utf8Bytes(head), len = utf8Bytes(literal);
    const line: PendingLine = { text: `${head}${literal}}\n`, bytes: headBytes + len + 2, to, head: headBytes, len };
    this.#write(line);
    const item = this.queues.add(to, ts, payload, seq, sender, size);
    line.item = item;
    if (line.at !== undefined) this.#stored(item, line.at, len);
    const waiting = this.#waiters.get(to);
    if (waiting) { for (const wake of waiting) wake(); }
    this.#maybeCompact();
    try {
      await this.writer.sync(); // group commit: concurrent sends share this fsync (and its one write)
    } catch (e) {
      throw this.#unavailable(e);
    }
    if (line.failed) throw this.#unavailable(line.failed); // held, then written with another record that failed
  }

  answerHold(from: string): AnswerHold {
    return new AnswerHold({ inFlight: this.answers, from }, this.opts.answers?.writeMs);
  }

  /** Whether `route`'s key has proven it reads its routes here: then every recv or ack of its routes needs a proof. */
  isOwned(route: string): boolean {
    return this.#owners.has(parseRoute(route).key);
  }

  get ownerCount(): number {
    return this.#owners.size;
  }

  verifiedBefore(route: string, proof: string): boolean {
    return this.#verified.get(route) === proof;
  }

  #addOwner(key: string): void {
    this.#owners.add(key);
    this.#ownerBytes += recordLine({ t: "o", q: key }).bytes;
  }

  get closedSince(): number | null {
    return this.#closedSince;
  }

  #setClosed(ts: number): void {
    this.#closedSince = ts;
    this.#ownerBytes += recordLine({ t: "c", ts }).bytes;
  }

  /**
   * `route`'s key proved with `proof` (verified, fresh) that it reads it. Its first proof makes it an owner, on disk
   * before the answer (trust on first proof survives a restart); when it cannot be one (`ownersMax` held, no disk
   * room), the bus closes instead (#close): a key that proved never has its routes served without a proof.
   */
  touchOwned(route: string, proof: string): void {
    this.#verified.set(route, proof);
    const key = parseRoute(route).key;
    if (this.#owners.has(key)) return;
    let why = `it protects the routes of ${this.ownersMax} keys, the most it keeps (--owners), and never forgets one`;
    if (this.#owners.size < this.ownersMax) {
      const line = recordLine({ t: "o", q: key });
      try {
        this.#ensureDisk(line.bytes);
        this.#write(line, true); // once per key, never held: the answer waits for it
        this.#addOwner(key);
        if (this.#owners.size === this.ownersMax) {
          this.#log(
            `this bus now protects ${this.ownersMax} keys, the most it keeps (--owners): the next new key closes it`,
          );
        }
        return;
      } catch (e) {
        why = `it has no room to record one more key that proved its routes (${(e as Error).message})`;
      }
    }
    if (this.#closedSince === null) this.#close(why);
  }

  /**
   * Closes the bus for good (restarts too): every recv or ack then needs a proof from its route's key, so keys it could
   * not record are as safe as its owners, and a node that never proves (a reference node) is refused. Keys cost
   * nothing, so a stranger can fill any record of them: this is where such a flood ends, at no memory cost. The "c"
   * record goes into the disk's reserve; this process stays closed even if that write fails (and throws).
   */
  #close(why: string): void {
    this.#setClosed(this.now());
    this.#log(
      `closed: ${why}; from now on every recv and ack needs a proof from its route's key (nodes that never prove, as reference nodes, are refused)`,
    );
    this.#write(recordLine({ t: "c", ts: this.#closedSince! }), true);
  }

  /**
   * Hands records to the write path: written now if no fdatasync runs (or `now`), else held for the next round's one
   * write (a lazy round is scheduled for records nobody awaits). A write now that fails throws the HTTP answer.
   */
  #write(lines: PendingLine | PendingLine[], now = false): void {
    const batch = Array.isArray(lines) ? lines : [lines];
    this.#pending.push(...batch);
    if (this.writer.syncing && !now) {
      if (batch.some((l) => l.len === undefined)) this.#syncSoon();
      return;
    }
    try {
      this.#flush();
    } catch (e) {
      throw this.#unavailable(e);
    }
  }

  /** Writes every held record as one append; on failure their messages leave memory (no 202: sent again) and it throws. */
  #flush(): void {
    const batch = this.#pending;
    if (!batch.length) return;
    this.#pending = [];
    let offset: number;
    try {
      offset = this.writer.appendText(batch.length === 1 ? batch[0].text : batch.map((l) => l.text).join(""));
      for (const l of batch) this.#disk.free -= l.bytes;
    } catch (e) {
      for (const l of batch) {
        l.failed = e;
        if (l.item && !l.item.gone) this.queues.remove(l.to!, l.item.seq);
      }
      throw e;
    }
    for (const l of batch) {
      if (l.len !== undefined) {
        l.at = offset + l.head!;
        if (l.item) this.#stored(l.item, l.at, l.len);
      }
      offset += l.bytes;
    }
  }

  #stored(item: Queued, at: number, len: number): void {
    item.at = at;
    item.len = len;
    item.payload = undefined;
  }

  #unavailable(e: unknown): HttpError {
    if (e instanceof HttpError) return e;
    if (e instanceof DiskFullError) {
      this.#log(`refusing writes: ${e.message}`);
      return new HttpError(507, `${e.message}; nothing was stored; retry later`);
    }
    this.#log(`cannot write the queue file: ${(e as Error).message}`);
    return new HttpError(
      503,
      `the bus cannot write its queue file (${(e as Error).message}); nothing was stored; retry later`,
    );
  }

  /** Up to `max` oldest un-acked messages for `me`, waiting up to `timeoutMs` for one ([] if none); kept until acked. */
  async recv(
    me: string,
    timeoutMs: number,
    signalOf?: AbortSignal | (() => AbortSignal),
    max = 1,
    held?: AnswerHold,
  ): Promise<BusDelivery[]> {
    const ready = this.take(me, max, held);
    if (ready.length || timeoutMs <= 0) return ready;
    const signal = typeof signalOf === "function" ? signalOf() : signalOf;
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
    for (;;) {
      const items = this.queues.firstN(me, max);
      let n = 0, bytes = 0;
      while (n < items.length && (n === 0 || bytes + items[n].size <= RECV_BATCH_BYTES)) bytes += items[n++].size;
      items.length = n;
      held?.hold(recvAnswerBytes(me, items));
      const out: BusDelivery[] = [];
      for (const item of items) {
        const payload = this.#payload(me, item);
        if (payload !== undefined) out.push({ seq: item.seq, ts: item.ts, payload });
      }
      if (out.length || !items.length) return out;
    }
  }

  /** A queued entry's payload JSON text (tests and tools; delivery uses `take`). */
  payloadOf(item: Queued): string {
    return item.payload ?? this.#readPayload(item) ?? "";
  }

  /** The bytes of `item`'s payload literal in the file (fewer if the file ends first), in a reused buffer. */
  #literalBytes(item: Queued): Buffer {
    if (this.#readBuf.length < item.len) this.#readBuf = Buffer.allocUnsafe(item.len);
    let got = 0;
    while (got < item.len) { // a read may return less than asked (a network file system) before the end
      const n = fs.readSync(this.#reader, this.#readBuf, got, item.len - got, item.at + got);
      if (n === 0) break;
      got += n;
    }
    return this.#readBuf.subarray(0, got);
  }

  /** The payload read back from the file; undefined when damaged there; a failed read (EIO) throws: it stays queued. */
  #readPayload(item: Queued): string | undefined {
    const bytes = this.#literalBytes(item);
    if (bytes.length !== item.len) return undefined;
    try {
      const text: unknown = JSON.parse(bytes.toString("utf8"));
      if (typeof text !== "string") return undefined;
      JSON.parse(text); // it goes into the answer as JSON: one flipped byte must not break every recv behind it
      return text;
    } catch {
      return undefined;
    }
  }

  /** The payload of `item`; undefined when damaged on disk: then quarantined and dropped, never blocking the queue. */
  #payload(me: string, item: Queued): string | undefined {
    if (item.payload !== undefined) return item.payload;
    const payload = this.#readPayload(item);
    if (payload !== undefined) return payload;
    this.#log(`the queued message seq ${item.seq} for ${fingerprint(me)}… is damaged on disk; set aside in .corrupt`);
    this.queues.remove(me, item.seq);
    this.dead += 2;
    try {
      quarantineLine(this.writer.file, item.at, item.len, "damaged payload", this.#literalBytes(item).toString());
      this.#write(recordLine({ t: "d", q: me, n: item.seq }));
      this.#syncSoon();
    } catch {
      // a restart re-reads the record, finds it unreadable and sets it aside again
    }
    return undefined;
  }

  /**
   * Acks `seqs` of `me` (unknown ones ignored: idempotent), each marked in place before the answer (#markAcked): no
   * disk room needed, so a full disk never stops receivers draining it, and a bus crash never brings an acked message
   * back. Fsynced lazily: a power cut can, a redelivery receivers dedupe. A record not where its entry says (an older
   * layout) gets an appended "a" record; if that cannot be written, the ack is refused and the message stays.
   */
  ack(me: string, ...seqs: number[]): void {
    if (!seqs.some((seq) => this.queues.has(me, seq))) return;
    try {
      this.#flush(); // a message still held for the next write gets its record, to be marked
    } catch {
      // those held messages left memory and their senders are answered 507: nothing of them to ack
    }
    const appended: number[] = [];
    try {
      for (const seq of new Set(seqs)) {
        const item = this.queues.get(me, seq);
        if (!item) continue;
        const bytes = this.#markAcked(me, item);
        if (!bytes) {
          appended.push(seq);
          continue;
        }
        this.queues.remove(me, seq);
        this.dead += 2; // as a message and its ack record weigh: compaction comes as often as before
        this.#deadBytes += bytes;
      }
      if (!appended.length) return;
      const lines = appended.map((seq) => recordLine({ t: "a", q: me, n: seq }));
      this.#write(lines, true);
      for (const seq of appended) this.queues.remove(me, seq);
      this.dead += 2 * appended.length;
      this.#deadBytes += lines.reduce((n, l) => n + l.bytes, 0);
    } finally {
      this.#syncSoon();
      this.#maybeCompact();
    }
  }

  /**
   * Acks `item` in place: its tag's "m" becomes "a", an ack record of the same route and seq (an older bus reads it
   * too); one byte overwritten needs no disk room. The record's bytes, or 0 when it is not in today's layout exactly
   * where its entry says (still held, an older layout, a failed read or write).
   */
  #markAcked(me: string, item: Queued): number {
    if (item.at < 0 || item.payload !== undefined) return 0;
    const head = Buffer.from(messageHead(me, item.seq, item.ts, item.sender, item.size));
    const start = item.at - head.length;
    if (start < 0) return 0;
    try {
      const found = Buffer.alloc(head.length);
      if (fs.readSync(this.#reader, found, 0, head.length, start) !== head.length || !found.equals(head)) return 0;
      if (fs.writeSync(this.#reader, ACKED_TAG, 0, 1, start + ACKED_TAG_AT) !== 1) return 0;
    } catch {
      return 0;
    }
    return head.length + item.len + 2;
  }

  #syncSoon(): void {
    if (this.#syncTimer) return;
    this.#syncTimer = setTimeout(() => {
      this.#syncTimer = null;
      this.writer.sync().catch((e) => this.#log(`fsync failed: ${(e as Error).message}`));
    }, 50);
  }

  /**
   * Rewrites the file to its live messages once dead records dominate (or `force`): disk use tracks what is held.
   * Payloads are copied file to file, never into memory. On failure (a full disk) the old file stays in use, whole,
   * and the next try waits COMPACT_RETRY_MS.
   */
  #maybeCompact(opening = false, force = false): void {
    const due = this.dead >= Math.max(this.opts.compactMinDead ?? COMPACT_MIN_DEAD, this.queues.liveCount);
    if (!force && !due && !this.#spaceToReclaim()) return;
    if (this.now() < this.#compactAfter) return;
    const placed: [Queued, number, number][] = [];
    const cut: [string, number][] = []; // live messages the file no longer holds whole: left out, set aside
    let reader: number | undefined; // on the new file, opened before it replaces the old one
    try {
      this.writer.rewrite((write) => {
        write(recordLine({ t: "h", next: this.queues.nextSeq }).text);
        if (this.#closedSince !== null) write(recordLine({ t: "c", ts: this.#closedSince }).text);
        for (const q of this.#owners) write(recordLine({ t: "o", q }).text);
        for (const [q, m] of this.queues.live()) {
          const head = messageHead(q, m.seq, m.ts, m.sender, m.size);
          let literal: Uint8Array;
          if (m.payload !== undefined) literal = Buffer.from(JSON.stringify(m.payload));
          else {
            literal = this.#literalBytes(m);
            if (literal.length !== m.len) { // the file was cut short from outside: as at delivery, it cannot block
              setAside(this.writer.file, m.at, "payload cut short", Buffer.from(literal).toString());
              cut.push([q, m.seq]);
              continue;
            }
          }
          const at = write(head) + utf8Bytes(head);
          write(literal);
          write("}\n");
          placed.push([m, at, literal.length]);
        }
      }, (tmp) => {
        reader = fs.openSync(tmp, "r+");
        if (!opening) failpoint("bus-mid-compact"); // the new file written and synced, not yet in place
      });
    } catch (e) {
      if (reader !== undefined) fs.closeSync(reader);
      this.#compactAfter = this.now() + COMPACT_RETRY_MS;
      this.#log(`compaction failed, the queue file stays as it was: ${(e as Error).message}`);
      return;
    }
    // The new file holds every live message and what the held records said: nothing is left to write.
    this.#pending = [];
    fs.closeSync(this.#reader);
    this.#reader = reader!;
    for (const [m, at, len] of placed) this.#stored(m, at, len);
    for (const [q, seq] of cut) {
      this.queues.remove(q, seq);
      this.#log(`the queued message seq ${seq} for ${fingerprint(q)}… was cut short on disk; set aside in .corrupt`);
    }
    this.dead = 0;
    this.#deadBytes = 0;
    this.#diskFree(true);
    if (!opening) failpoint("bus-after-compact");
  }

  /**
   * Compact early when the disk has under twice the reserve free, DISK_RECLAIM_BYTES is dead, and the new file fits:
   * a disk our messages filled gets its room back as they are read.
   */
  #spaceToReclaim(): boolean {
    if (this.#deadBytes < DISK_RECLAIM_BYTES) return false;
    const free = this.#diskFree();
    return free < 2 * this.diskReserve() && this.#ownerBytes + this.queues.charged < free;
  }

  async close(): Promise<void> {
    for (const set of this.#waiters.values()) for (const wake of set) wake();
    if (this.#syncTimer) clearTimeout(this.#syncTimer);
    this.#syncTimer = null;
    await this.writer.sync().catch(() => {});
    this.writer.close();
    fs.closeSync(this.#reader);
    this.lock.release();
  }
}

function recordLine(record: Exclude<BusRecord, { t: "m" }>): PendingLine {
  const text = JSON.stringify(record) + "\n";
  return { text, bytes: utf8Bytes(text) };
}

interface RecoveryReport {
  messages: number;
  recipients: number;
  skippedLines: number;
  ms: number;
}

/** `recipient NUL seq:ts`: see "The bus" for why the ts. */
const ackKey = (me: string, m: { seq: number; ts: number }) => `${me}\0${m.seq}:${m.ts}`;

/** At least the bytes of a GET /recv answer to `me` of `items`: per message its payload, ts, ack key and JSON around. */
function recvAnswerBytes(me: string, items: readonly Queued[]): number {
  const perMessage = utf8Bytes(JSON.stringify(me)) + 112;
  return items.reduce((n, m) => n + m.size + perMessage, 64);
}

/** The seq of the queued message an ack key names, or undefined; a key without ":ts" (an earlier bus's) names the seq. */
function ackedSeq(bus: Bus, me: string, key: string): number | undefined {
  const m = /^(\d{1,16})(?::(-?\d{1,16}))?$/.exec(key.slice(me.length + 1)); // a ts is any safe integer on disk
  const item = m ? bus.queues.get(me, Number(m[1])) : undefined;
  return item && (m![2] === undefined || item.ts === Number(m![2])) ? item.seq : undefined;
}

/** A recv/ack proof is honoured this long either side of its ts (clients renew theirs every minute). */
const RECV_PROOF_FRESH_MS = 5 * 60_000;

/**
 * Keys whose routes a bus protects at most (`--owners`): far above any real deployment, about 6 MB of queue file and
 * 10 MB of memory. Past it the bus closes (Bus.touchOwned): forgetting an owner would let a flood of keys open its mail.
 */
const OWNERS_MAX = 100_000;

/** Routes whose last verified proof is remembered, so a client's repeats skip the signature check (a minute each). */
const PROOFS_REMEMBERED = 4096;

/**
 * Recipient ownership, trust on first proof: once a key has proven (a signed recv or ack) that it reads one of its
 * routes, unproven recv and ack of all its routes are refused for good, so nobody else reads or deletes its mail. Keys
 * that never proved work as in the reference contract until the bus closes (Bus.#close). Every proof, a repeat too,
 * must be fresh: a captured one is worth nothing RECV_PROOF_FRESH_MS after its ts. Throws the 403.
 */
async function checkOwnership(bus: Bus, route: string, proof: unknown): Promise<void> {
  if (proof === undefined || proof === null || proof === "") {
    if (bus.isOwned(route)) {
      const fp = fingerprint(route);
      throw new HttpError(
        403,
        `route ${fp}… belongs to a key that has proven its ownership to this bus: a recv or ack for it must carry a proof signed by that key`,
      );
    }
    if (bus.closedSince !== null) {
      const at = new Date(bus.closedSince); // a hand-made "c" record may hold a safe integer past what a Date holds
      const since = Number.isNaN(at.getTime()) ? `ts ${bus.closedSince}` : at.toISOString();
      throw new HttpError(
        403,
        `this bus serves no route without a proof since ${since} (it could not record every key that proved its routes): a recv or ack must carry a proof signed by the route's key`,
      );
    }
    return;
  }
  if (typeof proof !== "string" || !/^\d{1,16}\.[A-Za-z0-9_-]{86}$/.test(proof)) {
    throw new HttpError(400, 'proof must be "<ts>.<signature>"');
  }
  const [tsText, sig] = proof.split(".");
  const ts = Number(tsText);
  if (Math.abs(bus.now() - ts) > RECV_PROOF_FRESH_MS) {
    throw new HttpError(
      403,
      `proof is outside its freshness window (${RECV_PROOF_FRESH_MS / 60_000} min either side of this bus's clock)`,
    );
  }
  if (!bus.verifiedBefore(route, proof)) {
    const bad = await verifyDetached(parseRoute(route).key, sig, recvProofBytes(route, ts));
    if (bad) throw new HttpError(403, `proof does not verify for ${fingerprint(route)}…: ${bad}`);
  }
  bus.touchOwned(route, proof);
}

/** What this bus adds to the reference contract, named in an `interlink-bus` header on GET /roster (doctor reads it). */
const BUS_FEATURES = `${VERSION} ownership signed-unregister verified-roster batch-recv batch-send full-refused`;

/**
 * The verified signer of a v2-shaped payload, so room is shared fairly between senders; "" for any other (opaque, as
 * the reference contract says). A malformed or forged v2 payload is a 400: the bus never queues a known forgery.
 */
async function signerOf(payload: unknown, route: string): Promise<string> {
  if (!isV2Shaped(payload)) return "";
  let msg: SignedMessage;
  try {
    msg = parseSignedMessage(payload);
  } catch (e) {
    // A kind or field this version does not know (a newer node's): relayed as opaque, as the reference contract says.
    if (e instanceof FormatError) return "";
    throw e;
  }
  const bad = await verifyMessage(msg);
  if (bad) throw new HttpError(400, `the message's signature does not verify (${bad}); not queued`);
  // Else a copy of one of alice's messages, posted to other routes, would spend her budget and crowd her out.
  const { key } = parseRoute(route);
  if (msg.to !== key) throw new HttpError(400, `the message is addressed to ${fingerprint(msg.to)}, not to this route`);
  return msg.from;
}

const isV2Shaped = (p: unknown): p is Record<string, string> =>
  isObject(p) && ["from", "to", "msg_id", "sig"].every((k) => typeof p[k] === "string");

/** The signer a stored payload claims, unverified; "" if it is not a v2 message. */
function claimedSender(payload: string): string {
  try {
    const p = JSON.parse(payload);
    return isV2Shaped(p) ? p.from : "";
  } catch {
    return "";
  }
}

async function readKeyedBody(
  req: Request,
  what: string,
  budget?: InFlightBudget,
): Promise<Record<string, unknown> & { pubkey: string }> {
  const body = await readJsonBody(req, budget, ANNOUNCEMENT_VALUES_MAX);
  if (!isObject(body) || typeof body.pubkey !== "string" || body.pubkey === "") {
    throw new HttpError(400, `${what} needs a "pubkey"`);
  }
  return body as Record<string, unknown> & { pubkey: string };
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

/**
 * Our extension of POST /send: {"messages": [{"to", "payload"}, ...]}, in order, each checked as a single send. The
 * first refused stops the rest, so a sender's order holds. Answered 200 once all queued are on disk, one result per
 * message tried: {"status": 202} or {"status": <4xx/5xx>, "error"}. A reference bus refuses the shape (no "to").
 */
async function sendMany(bus: Bus, items: unknown[]): Promise<Response> {
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
      const sender = await signerOf(item.payload, to);
      bus.ensureRoom(sender, utf8Bytes(payload), to);
      bus.ensureRouteRoom(to, sender); // a full route stops the batch here, as any refusal does
      queued.push(bus.send(to, payload, sender)); // in the queue now, in order; on disk once awaited
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

/** A request URL's path and query, without building a URL object (every request; only /recv reads the query). */
function splitUrl(url: string): { pathname: string; query: string } {
  const scheme = url.indexOf("://");
  const slash = url.indexOf("/", scheme < 0 ? 0 : scheme + 3);
  if (slash < 0) return { pathname: "/", query: "" };
  const q = url.indexOf("?", slash);
  const hash = url.indexOf("#", slash);
  const end = hash < 0 ? url.length : hash;
  return q < 0 || q > end
    ? { pathname: url.slice(slash, end), query: "" }
    : { pathname: url.slice(slash, q), query: url.slice(q + 1, end) };
}

/** What a bus route reads besides the Request: its query string and address bucket (see addressBucket). */
interface BusCall {
  query: string;
  from: string;
}

const BUS_ROUTES: Record<string, { method: string; handle(bus: Bus, req: Request, call: BusCall): Promise<Response> }> =
  {
    "/send": {
      method: "POST",
      async handle(bus, req, { from }) {
        // A body that could not fit the global budget is refused unread: a flood of big bodies costs no memory.
        const declared = declaredLength(req) ?? 0;
        if (declared > 0) bus.ensureRoom("", declared, "", true);
        const body = await readJsonBody(req, { inFlight: bus.inFlight, from });
        if (isObject(body) && Array.isArray(body.messages)) return await sendMany(bus, body.messages);
        if (!isObject(body)) throw new HttpError(400, 'expected {"to": <recipient>, "payload": <any JSON>}');
        const to = recipientParam(body.to, "to");
        if (body.payload === undefined) throw new HttpError(400, '"payload" is missing');
        await bus.send(to, JSON.stringify(body.payload), await signerOf(body.payload, to));
        return jsonResponse(202, '{"status":"queued"}');
      },
    },
    "/recv": {
      method: "GET",
      async handle(bus, req, { query, from }) {
        const params = new URLSearchParams(query);
        const me = recipientParam(params.get("me"), "me");
        await checkOwnership(bus, me, params.get("proof") ?? undefined);
        // Our extension: max=N (2 to RECV_BATCH_MAX) answers up to N at once, in another shape ("messages") that
        // no client which did not ask can take for one message; a reference bus ignores max and answers one.
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
      },
    },
    "/ack": {
      method: "POST",
      async handle(bus, req, { from }) {
        const body = await readJsonBody(req, { inFlight: bus.inFlight, from });
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
        await checkOwnership(bus, me, body.proof);
        // Unknown or already acked: still 200, acks are idempotent.
        bus.ack(me, ...(keys as string[]).map((k) => ackedSeq(bus, me, k)).filter((seq) => seq !== undefined));
        return jsonResponse(200, '{"status":"acked"}');
      },
    },
    "/announce": {
      method: "POST",
      async handle(bus, req, { from }) {
        const body = await readKeyedBody(req, "an announcement", { inFlight: bus.inFlight, from });
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
        if (filed !== true && filed !== "older") { // an older one: already superseded, nothing to say
          const { cap, perKeyCap, perAddressCap } = bus.roster;
          const live = `heard from in the last ${PRESENCE_LIVE_MS / 1000} s`;
          const session = fingerprint(a.pubkey) +
            (a.session?.session_id ? `#${a.session.session_id.slice(0, 128)}` : "");
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
        }
        return jsonResponse(202, '{"status":"announced"}');
      },
    },
    "/unregister": {
      method: "POST",
      async handle(bus, req, { from }) {
        const body = await readKeyedBody(req, "an unregister", { inFlight: bus.inFlight, from });
        if (body.sig === undefined) {
          throw new HttpError(
            403,
            "unsigned unregister refused: only the key that announced a session may remove it (interlink-unregister-v1); the entry ages out to away by itself",
          );
        }
        const sessionId = isObject(body.session) && typeof body.session.session_id === "string"
          ? body.session.session_id
          : "";
        const u = parseOr400(() => ({
          pubkey: field(body, "pubkey"),
          session_id: sessionId,
          ts: timestamp(body, "ts"),
          sig: field(body, "sig"),
        }));
        const now = bus.now();
        if (u.ts - now > FRESH_FUTURE_MS || now - u.ts > UNREGISTER_FRESH_MS) {
          throw new HttpError(400, "unregister ts is outside the freshness window");
        }
        if (await verifyDetached(u.pubkey, u.sig, parseOr400(() => unregisterBytes(u)))) {
          throw new HttpError(403, "unregister signature does not verify");
        }
        bus.roster.end(sessionId ? `${u.pubkey}#${sessionId}` : u.pubkey, u.ts, from, now);
        return jsonResponse(202, '{"status":"unregistered"}');
      },
    },
    "/roster": {
      method: "GET",
      handle(bus, _req, { from }) {
        const held = bus.answerHold(from);
        held.hold(bus.roster.answerBytes()); // before the answer is made: a refused read costs nothing
        return Promise.resolve(streamedAnswer(200, `{"roster":[${bus.roster.list(bus.now()).join(",")}]}`, held));
      },
    },
  };

interface Listening {
  port: number;
  stop(): Promise<void>;
}

/**
 * Binds a fetch handler, told each request's source address, to a TCP port with the runtime's own server. `guard`
 * (Deno only; Bun closes idle connections itself): node:http, whose timeouts close idle and slow connections
 * (Deno.serve never does), at a cost in throughput.
 */
function serveHttp(
  handler: (req: Request, from: string) => Promise<Response>,
  hostname: string,
  port: number,
  guard = false,
): Promise<Listening> {
  const { Bun, Deno } = runtimeHost;
  if (Deno && guard) return serveGuarded(handler, hostname, port);
  if (Bun) {
    // idleTimeout counts while a long-poll waits: keep it above RECV_TIMEOUT_MAX_MS.
    const server = Bun.serve({
      hostname,
      port,
      idleTimeout: Math.ceil(RECV_TIMEOUT_MAX_MS / 1000) + 30,
      development: false, // see serverError
      fetch: (req, server) => handler(req, server.requestIP(req)?.address ?? ""),
      error: serverError,
    });
    return Promise.resolve({ port: server.port, stop: () => Promise.resolve(server.stop(true)) });
  }
  if (Deno) {
    // Out of file descriptors (20,000 idle sockets: Deno.serve has no idle timeout), its accept loop fails and
    // would take the process down: logged instead, and it listens again on the same port a second later.
    const serve = (req: Request, info: { remoteAddr: { hostname: string } }) =>
      handler(req, info.remoteAddr?.hostname ?? "");
    let server = Deno.serve({ hostname, port, onListen: () => {}, onError: serverError }, serve);
    const bound = server.addr.port;
    let stopping = false;
    let retry: ReturnType<typeof setTimeout> | undefined;
    const watch = (s: typeof server) =>
      s.finished.catch((e: Error) => {
        if (stopping) return;
        logWarn(`the HTTP listener failed (${e.message}); listening again on port ${bound} in 1 s`);
        retry = setTimeout(function relisten() {
          if (stopping) return;
          try {
            server = Deno.serve({ hostname, port: bound, onListen: () => {}, onError: serverError }, serve);
            watch(server);
          } catch (e) {
            logWarn(`cannot listen on port ${bound} yet (${(e as Error).message}); trying again in 1 s`);
            retry = setTimeout(relisten, 1000);
          }
        }, 1000);
      });
    watch(server);
    return Promise.resolve({
      port: bound,
      stop: () => {
        stopping = true;
        clearTimeout(retry);
        return server.shutdown();
      },
    });
  }
  throw new InterlinkError("interlink.ts needs Bun or Deno to serve HTTP");
}

/** A handler that throws: a generic 500, the error logged; never Bun's page of paths and source lines. */
function serverError(e: unknown): Response {
  logWarn(`a request failed inside the server: ${(e as Error)?.stack ?? e}`);
  return new Response("internal error\n", { status: 500, headers: { "content-type": "text/plain; charset=utf-8" } });
}

/** A guarded server closes a connection idle this long between requests, or this slow to send its headers. */
const CONN_IDLE_MS = msFromEnv("INTERLINK_TEST_CONN_IDLE_MS", 10_000);

/** ... and one whose request body is not all there this long after its headers (a byte every few seconds). */
const CONN_BODY_MS = msFromEnv("INTERLINK_TEST_CONN_BODY_MS", 15_000);

/** A large answer not all taken this long after it was made is cut off (4 MiB in 30 s: a 140 KB/s link at least). */
const ANSWER_WRITE_MS = msFromEnv("INTERLINK_TEST_ANSWER_WRITE_MS", 30_000);

/** How long a guarded server's self-check waits to see its own connection accepted (see serveGuarded). */
const CONN_PROBE_MS = msFromEnv("INTERLINK_TEST_CONN_PROBE_MS", 3_000);

/** Connections a guarded server holds at most (see connectionBound). */
const CONN_MAX = 10_000;

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

/**
 * Writes a streamed answer to `res` a slice at a time, each after the one before drained: a stalled reader holds
 * one slice. A close cancels the stream (its bytes given back); a failed one throws. False when the connection closed.
 */
async function writeWithBackpressure(
  body: ReadableStream<Uint8Array>,
  res: import("node:http").ServerResponse,
): Promise<boolean> {
  const reader = body.getReader();
  const gone = () => void reader.cancel().catch(() => {});
  res.once("close", gone);
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (res.destroyed) return (gone(), false);
      if (done) return true;
      if (res.write(value)) continue;
      await new Promise<void>((resolve) => {
        const on = () => (res.off("drain", on), res.off("close", on), resolve());
        res.on("drain", on).on("close", on);
      });
    }
  } finally {
    res.off("close", gone);
  }
}

/**
 * The guarded server (see serveHttp): node:http with keep-alive and header timeouts, a deadline on the body, a bound
 * on connections, no request timeout (a long-poll waits a minute). A client gone aborts its request's signal.
 */
async function serveGuarded(
  handler: (req: Request, from: string) => Promise<Response>,
  hostname: string,
  port: number,
): Promise<Listening> {
  const [http, { connect }] = await Promise.all([import("node:http"), import("node:net")]);
  const timeouts = {
    keepAliveTimeout: CONN_IDLE_MS,
    headersTimeout: CONN_IDLE_MS,
    requestTimeout: 0, // under Deno it would cut long-polls too
    connectionsCheckingInterval: 1_000, // how often headersTimeout is checked (30 s by default)
  };
  const server = http.createServer(timeouts, async (req, res) => {
    const gone = new AbortController();
    res.on("close", () => res.writableFinished || gone.abort());
    const socket = req.socket; // detached from req once the answer is sent
    try {
      const declared = req.headers["content-length"];
      let body: Buffer | undefined;
      let whole = false; // the body was read to its end
      // Read on demand, so the handler's checks on the declared length come first and a body it refuses is never
      // held; with a deadline, and one chunk past the limit at most (enough for a 413).
      const readBody = async (): Promise<Buffer> => {
        if (body) return body;
        const deadline = setTimeout(() => socket.destroy(), CONN_BODY_MS);
        const chunks: Buffer[] = [];
        let n = 0;
        try {
          for await (const c of req) if ((n += c.length, chunks.push(c), n) > BODY_LIMIT_BYTES) break;
          whole = n <= BODY_LIMIT_BYTES;
        } finally {
          clearTimeout(deadline);
        }
        return body = Buffer.concat(chunks);
      };
      const hasBody = req.method !== "GET" && req.method !== "HEAD";
      // A chunked body is handed over as it comes, so the handler counts each chunk before the next is read.
      const chunked = hasBody && declared === undefined
        ? {
          getReader() {
            const chunks = req[Symbol.asyncIterator]();
            const deadline = setTimeout(() => socket.destroy(), CONN_BODY_MS);
            return {
              async read(): Promise<IteratorResult<Uint8Array>> {
                try {
                  const r = await chunks.next();
                  if (r.done) (whole = true, clearTimeout(deadline));
                  return r;
                } catch (e) {
                  clearTimeout(deadline);
                  throw e;
                }
              },
              cancel: () => Promise.resolve(clearTimeout(deadline)),
            };
          },
        }
        : null;
      // The handler reads only these parts of a Request; a real one costs more than the rest of the adapter.
      const lite = {
        url: `http://${hostname}${req.url ?? "/"}`,
        method: req.method,
        headers: {
          get(name: string): string | null {
            if (name.toLowerCase() === "content-length") return declared ?? null;
            const v = req.headers[name.toLowerCase()];
            return v === undefined ? null : Array.isArray(v) ? v.join(", ") : v;
          },
        },
        body: chunked,
        text: async () => (hasBody ? (await readBody()).toString("utf8") : ""),
        signal: gone.signal,
      };
      // A handler that throws while the client is still there gets the generic 500; one that is gone, nothing.
      const r = await handler(lite as unknown as Request, socket.remoteAddress ?? "").catch((e) =>
        gone.signal.aborted ? Promise.reject(e) : serverError(e)
      );
      // A body left unread (refused, or past the limit) is not waited for: the connection closes after the answer.
      const unread = (hasBody || Number(declared) > 0) && !whole;
      const headers = { ...Object.fromEntries(r.headers), ...(unread ? { connection: "close" } : {}) };
      if (STREAMED_ANSWERS.has(r)) {
        res.writeHead(r.status, headers);
        if (await writeWithBackpressure(r.body!, res)) res.end(() => unread && socket.destroy());
        return;
      }
      const text = await r.text();
      res.writeHead(r.status, headers);
      res.end(text, () => unread && socket.destroy());
    } catch {
      res.destroy(); // a client that went away, or a body cut off by its deadline: nothing to answer
    }
  });
  Object.assign(server, timeouts); // as properties too: some are read from there
  // Past the bound a new connection is closed at once and accepting goes on (node:http's maxConnections, under
  // Deno, stops accepting for good).
  const most = connectionBound();
  let open = 0;
  server.on("connection", (socket: net.Socket) => {
    open++;
    socket.once("close", () => open--);
    if (open > most) socket.destroy();
  });
  server.on("error", (e) => logWarn(`the HTTP server: ${(e as Error).message}`));
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, hostname, () => resolve());
  });
  const bound = (server.address() as net.AddressInfo).port; // the port, kept when listening anew
  // Past the file-descriptor limit, node:http under Deno stops accepting, silently and for good: every few seconds a
  // connection to ourselves checks one is still accepted; if not, it listens anew.
  let accepted = 0;
  server.on("connection", () => accepted++);
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
  return {
    port: bound,
    stop: () =>
      new Promise<void>((resolve) => {
        clearInterval(watchdog);
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}

// ============================================================================
// CLI
// ============================================================================

async function runBus(o: Options): Promise<number> {
  const host = o.host as string;
  const port = intOption(o.port, "port", 0, 65535);
  const cap = intOption(o.cap, "cap", 1, 10_000_000);
  const limits = {
    opaqueCap: intOption(o["opaque-cap"], "opaque-cap", 1, 10_000_000),
    senderBytes: intOption(o["sender-mb"], "sender-mb", 1, 1_000_000) * 2 ** 20,
    totalBytes: intOption(o["max-mb"], "max-mb", 1, 1_000_000) * 2 ** 20,
  };
  const compactMinDead = intOption(o.compact, "compact", 1, 100_000_000);
  const owners = intOption(o.owners, "owners", 1, 100_000_000);
  if (!["on", "off"].includes(String(o.guard))) throw new InterlinkError(`--guard must be on or off, not '${o.guard}'`);
  const dataDir = o.data as string;
  setLogComponent("interlink bus");
  const bus = await Bus.open(dataDir, { cap, compactMinDead, limits, owners });
  let server: Listening;
  try {
    server = await serveHttp(bus.handler, host, port, o.guard === "on");
  } catch (e) {
    await bus.close();
    throw new InterlinkError(`cannot listen on ${host}:${port}: ${(e as Error).message}`);
  }
  const r = bus.recovery;
  logInfo(
    `listening on http://${
      host.includes(":") ? `[${host}]` : host
    }:${server.port} (data ${dataDir}, cap ${cap} per sender and recipient)`,
  );
  logInfo(
    `recovered ${r.messages} un-acked messages for ${r.recipients} recipients in ${r.ms} ms` +
      (r.skippedLines ? `; skipped ${r.skippedLines} unreadable lines` : ""),
  );
  if (!isLoopback(host)) {
    logWarn(`bound to ${host}, not loopback: ${BUS_EXPOSURE}`);
  }
  const sig = await shutdownSignal();
  logInfo(`${sig}: shutting down`);
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
    data: option("DIR", "INTERLINK_BUS_DATA", busDataDir, "folder for the queue file (one bus per folder)"),
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
    guard: option(
      "on|off",
      "INTERLINK_BUS_GUARD",
      "on",
      `under Deno, serve with node:http so that idle (${CONN_IDLE_MS / 1000} s) and slow (${
        CONN_BODY_MS / 1000
      } s) connections are closed; off: Deno.serve, faster, but it never closes an idle connection (only where no hostile client can connect). Bun always closes them`,
    ),
    compact: option(
      "N",
      "INTERLINK_BUS_COMPACT",
      String(COMPACT_MIN_DEAD),
      "rewrite the queue file once this many records are dead (acked or dropped) and they outnumber the live ones",
    ),
  },
  run: runBus,
};

// -- the public surface: what node tests, the bench and the board import

export {
  Bus,
  BusQueues,
  CONN_BODY_MS,
  CONN_IDLE_MS,
  errorResponse,
  jsonResponse,
  MESSAGE_OVERHEAD_BYTES,
  messageHead,
  OPAQUE_CAP,
  RECV_BATCH_BYTES,
  RECV_TIMEOUT_MAX_MS,
  recvTimeoutMs,
  Roster,
  ROSTER_PER_ADDRESS_CAP,
  ROUTE_OVERHEAD_BYTES,
  SENDER_BYTES_MAX,
  serveHttp,
  splitUrl,
  TOTAL_BYTES_MAX,
};
export type { Listening };

if (import.meta.main) runExtra("bus", command);
