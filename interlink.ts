/**
 * interlink: authenticated, cross-machine chat and task delegation between
 * Claude Code sessions. One file; runs unchanged under Bun and Deno.
 *
 * Each session runs `interlink.ts mcp`, an MCP stdio server. A node's identity
 * is its Ed25519 public key; names are local petnames in peers.json. Every
 * message is signed over every field (task fields included) and passes one
 * deterministic gate, `decide`, before the model sees anything. Messages move
 * through a dumb, durable HTTP bus (`interlink.ts bus`) that verifies nothing
 * and keeps each message until its recipient acks it.
 *
 * Trust model
 *   - The authenticated key decides trust, never a claimed name or `from`
 *     string. Deny by default: only keys in peers.json may deliver text; a
 *     stranger may only knock (pair_request: a name, never actionable text).
 *   - A peer can never change trust for you: pairing and peer edits are the
 *     operator's decisions, and an unsolicited pair_accept is ignored.
 *   - Peer text is escaped before it reaches the model, so it cannot pose as a
 *     task header, a sender block or a system tag.
 *   - The wire format is the Rust interlink 0.4.x contract (SPEC.md): signing
 *     domain "interlink-v2", strict verification as ed25519-dalek's
 *     verify_strict (S < L, small-order keys and R rejected).
 *
 * What it does not defend
 *   - Confidentiality: messages are signed, not encrypted. The bus operator
 *     (and anyone on the path without TLS) reads everything.
 *   - Availability: a bus can drop, delay or reorder; it cannot forge.
 *   - A peer you allowlisted is trusted to ask for work; it is still not your
 *     operator, and the server instructions say so. A stolen key file is a
 *     stolen identity.
 *
 * Sections, in dependency order: constants, types, encoding and signing, the
 * gate, task folding, JSONL storage, the allowlist, the bus, the agent, MCP
 * tools, CLI, main.
 */

import { Buffer } from "node:buffer";
import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import { parseArgs } from "node:util";

// ============================================================================
// Constants
// ============================================================================

export const VERSION = "0.4.0";

/** Prefix of the signed bytes; a v1 signature or an announcement can never pass as a v2 message. */
export const SIGNING_DOMAIN = "interlink-v2\0";
export const ANNOUNCE_DOMAIN = "interlink-announce-v1\0";

/** A sender's clock may run this far ahead of ours before we call its message forged. */
export const FRESH_FUTURE_MS = 60_000;
/** The bus is durable: a message may legitimately sit in it for a day while we are offline. */
export const FRESH_PAST_MS = 24 * 60 * 60_000;
/** Re-sign an undelivered message before it would go stale at the recipient (same msg_id, so it still dedupes). */
const RESIGN_AFTER_MS = FRESH_PAST_MS - 60 * 60_000;

export const DEFAULT_BUS_PORT = 9440;
export const DEFAULT_BUS_URL = `http://127.0.0.1:${DEFAULT_BUS_PORT}`;
/** Default long-poll wait, as in interlink-bus. */
export const RECV_TIMEOUT_MS = 25_000;
/** Longest wait a client may ask for; past it proxies and NATs start cutting idle connections. */
export const RECV_TIMEOUT_MAX_MS = 60_000;
/** Per-recipient queue bound; past it the oldest is dropped (and logged) so one silent inbox cannot fill the disk. */
export const QUEUE_CAP = 1024;
/** Roster entries older than this are gone: agents re-announce every ANNOUNCE_EVERY_MS. */
export const ROSTER_TTL_MS = 90_000;
/** Roster bound: far above any real deployment, low enough that an announce flood costs a few MB. */
export const ROSTER_CAP = 4096;
export const ANNOUNCE_EVERY_MS = 30_000;
/** Largest request body the bus reads; a signed message is a few KB. */
export const BODY_LIMIT_BYTES = 1 << 20;
/** Longest text an agent will sign: comfortably inside the bus body limit after JSON escaping. */
export const TEXT_LIMIT_BYTES = 256 * 1024;
/** Longest recipient string the bus accepts: a 43-char key plus a label. */
const RECIPIENT_MAX_CHARS = 512;

/** One stalled bus must not wedge delivery to the others. */
const SEND_TIMEOUT_MS = 5_000;
const BACKOFF_MIN_MS = 250;
const BACKOFF_MAX_MS = 30_000;

/** Replay memory bound: a day of traffic from a handful of peers is far below it. */
export const REPLAY_CAP = 100_000;
/** Pending knocks kept per direction; a stranger flooding knocks only pushes out older knocks. */
const KNOCKS_CAP = 64;
/** Verifying keys cached by public key; peers are few, so this only bounds strangers. */
const KEY_CACHE_CAP = 1024;

/** Compact the bus queue file once dead records outnumber live ones and this floor. */
const COMPACT_MIN_DEAD = 10_000;
/** How long a short-lived lock (peers edit, inbox claim) is waited for before giving up. */
const SHORT_LOCK_WAIT_MS = 5_000;

const PETNAME_RE = /^[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}$/;
const INBOX_LABEL_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

/** Bun and Deno both expose their version; this names the runtime in logs and `doctor`. */
const runtimeHost = globalThis as unknown as {
  Bun?: BunRuntime;
  Deno?: DenoRuntime;
};

// ============================================================================
// Types
// ============================================================================

export const KINDS = ["message", "pair_request", "pair_accept"] as const;
export type Kind = (typeof KINDS)[number];

export const STATUSES = ["update", "needs_input", "result", "failed", "canceled"] as const;
export type TaskStatus = (typeof STATUSES)[number];
export const TERMINAL_STATUSES: ReadonlySet<string> = new Set(["result", "failed", "canceled"]);

/** A message as it travels: every field below `sig` is covered by it. */
export interface SignedMessage {
  from: string;
  to: string;
  text: string;
  ts: number;
  msg_id: string;
  kind: Kind;
  task_id?: string;
  status?: TaskStatus;
  in_reply_to?: string;
  sig: string;
}

/** A self-signed presence claim published on the bus roster. */
export interface Announcement {
  pubkey: string;
  name: string;
  ts: number;
  sig: string;
}

/** The allowlist: petname → key and its inverse (both unique). */
export interface Peers {
  byName: ReadonlyMap<string, string>;
  byKey: ReadonlyMap<string, string>;
}

export const REJECT_REASONS = [
  "malformed",
  "bad_signature",
  "wrong_recipient",
  "not_allowlisted",
  "stale",
  "replay",
  "unexpected_kind",
] as const;
export type RejectReason = (typeof REJECT_REASONS)[number];

/** What the gate decided about one payload drained from a bus. */
export type Verdict =
  | { verdict: "deliver"; msg: SignedMessage; petname: string }
  | { verdict: "pair_request"; msg: SignedMessage; claimedName: string }
  | { verdict: "pair_accept"; msg: SignedMessage }
  | { verdict: "reject"; reason: RejectReason; detail: string; msg?: SignedMessage };

/** A bad input that a person can act on; the message says what and why. */
export class InterlinkError extends Error {}
/** A payload or file that does not have the shape the contract requires. */
export class FormatError extends InterlinkError {}

interface BunServer {
  port: number;
  stop(force?: boolean): void;
}
interface BunRuntime {
  version: string;
  serve(options: {
    hostname: string;
    port: number;
    idleTimeout?: number;
    fetch(req: Request): Response | Promise<Response>;
  }): BunServer;
}
interface DenoRuntime {
  version: { deno: string };
  execPath(): string;
  serve(
    options: { hostname: string; port: number; onListen?: (addr: { port: number }) => void },
    handler: (req: Request) => Response | Promise<Response>,
  ): { finished: Promise<void>; shutdown(): Promise<void>; addr: { port: number } };
}

// ============================================================================
// Runtime and logging
// ============================================================================
//
// stdout belongs to MCP (and to command output); every log line goes to
// stderr with a component prefix.

let logComponent = "interlink";
let logDebugEnabled = false;

function logLine(level: string, msg: string): void {
  process.stderr.write(`${new Date().toISOString()} ${logComponent} ${level}: ${msg}\n`);
}
export const logInfo = (msg: string): void => logLine("info", msg);
export const logWarn = (msg: string): void => logLine("warn", msg);
const logDebug = (msg: string): void => {
  if (logDebugEnabled) logLine("debug", msg);
};

/** "bun 1.4.5" or "deno 2.9.6": the runtime running this file. */
export function runtimeName(): string {
  if (runtimeHost.Bun) return `bun ${runtimeHost.Bun.version}`;
  if (runtimeHost.Deno) return `deno ${runtimeHost.Deno.version.deno}`;
  return `node ${process.version}`;
}

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

// ============================================================================
// Encoding and signing
// ============================================================================

const utf8 = new TextEncoder();
/** Bytes on an ordinary ArrayBuffer, the only kind WebCrypto takes. */
type Bytes = Uint8Array<ArrayBuffer>;

export function b64urlEncode(bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("base64url");
}

const B64URL_RE = /^[A-Za-z0-9_-]*$/;

/**
 * Strict unpadded base64url of exactly `byteLength` bytes. Re-encoding must give
 * the same text, so no key or signature has two spellings (which would let a
 * relay mint a "different" message or a second name for one identity).
 */
export function b64urlDecode(text: unknown, byteLength: number, what: string): Bytes {
  const chars = Math.ceil((byteLength * 4) / 3);
  if (typeof text !== "string" || text.length !== chars || !B64URL_RE.test(text)) {
    throw new FormatError(`${what} is not ${byteLength} bytes of unpadded base64url`);
  }
  const bytes = new Uint8Array(Buffer.from(text, "base64url"));
  if (bytes.length !== byteLength || b64urlEncode(bytes) !== text) {
    throw new FormatError(`${what} is not canonical base64url`);
  }
  return bytes;
}

export const decodeKey = (text: unknown, what = "key"): Bytes => b64urlDecode(text, 32, what);

/** Display-only short form of a key; never used to decide anything. */
export const fingerprint = (key: string): string => key.slice(0, 8);

function u32le(n: number): Bytes {
  const out = new Uint8Array(4);
  new DataView(out.buffer).setUint32(0, n, true);
  return out;
}

function u64le(n: number): Bytes {
  const out = new Uint8Array(8);
  new DataView(out.buffer).setBigUint64(0, BigInt(n), true);
  return out;
}

function concatBytes(parts: Uint8Array[]): Bytes {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

const lengthPrefixed = (s: string): Uint8Array[] => {
  const bytes = utf8.encode(s);
  return [u32le(bytes.length), bytes];
};

/**
 * The bytes a message signature covers (SPEC "Canonical bytes"). Each property
 * blocks an attack:
 *   - the domain prefix: a v1 signature, or an announcement, replayed as a v2 message;
 *   - raw `from` and `to`: a message re-addressed to another node, or claimed by another sender;
 *   - `ts`: an old message replayed as new once the replay memory forgot it;
 *   - length-prefixed fields: moving bytes from one field into the next
 *     ("text=ab, task=c" versus "text=a, task=bc");
 *   - `kind`: a chat message re-typed into a knock or an accept;
 *   - `status`, `task_id`, `in_reply_to`: a relay forging a cancel, flipping a
 *     status, moving a message to another task or answering another question.
 *     An absent field is the empty string, so dropping one changes the bytes.
 */
export function canonicalBytes(m: Omit<SignedMessage, "sig">): Bytes {
  return concatBytes([
    utf8.encode(SIGNING_DOMAIN),
    decodeKey(m.from, "from"),
    decodeKey(m.to, "to"),
    u64le(m.ts),
    ...[m.kind, m.msg_id, m.text, m.status ?? "", m.task_id ?? "", m.in_reply_to ?? ""].flatMap(lengthPrefixed),
  ]);
}

export function announcementBytes(a: Omit<Announcement, "sig">): Bytes {
  return concatBytes([
    utf8.encode(ANNOUNCE_DOMAIN),
    decodeKey(a.pubkey, "pubkey"),
    ...lengthPrefixed(a.name),
    u64le(a.ts),
  ]);
}

// Curve constants (RFC 8032 §5.1) for the small-order test below.
const P = 2n ** 255n - 19n;
/** d = −121665/121666 mod p */
const D = 37095705934669439343138083508754565189542113879843219016388785533085940283555n;
/** Order of the prime subgroup; a signature's S must be below it. */
const L = 2n ** 252n + 27742317777372353535851937790883648493n;

function littleEndianToBigInt(bytes: Uint8Array): bigint {
  let n = 0n;
  for (let i = bytes.length - 1; i >= 0; i--) n = (n << 8n) | BigInt(bytes[i]);
  return n;
}

/**
 * True if the encoded point has order dividing 8: [8]P is the identity. With
 * such a public key and R, the signature equation holds for any message
 * (the vector "small-order sender key"), and WebCrypto in Bun and Deno accepts
 * it. Doubling depends only on y here, x² = (y² − 1)/(d·y² + 1), so three
 * doublings run on y alone in projective form (Y:Z) with no inversion; the
 * identity is the only point with y = 1. Works on non-canonical y as well.
 */
export function hasSmallOrder(encoded: Uint8Array): boolean {
  const yBytes = encoded.slice(0, 32);
  yBytes[31] &= 0x7f;
  let Y = littleEndianToBigInt(yBytes) % P;
  let Z = 1n;
  for (let i = 0; i < 3; i++) {
    const Y2 = (Y * Y) % P;
    const Z2 = (Z * Z) % P;
    const xNum = (Y2 - Z2 + P) % P;
    const xDen = (D * Y2 + Z2) % P;
    // On −x² + y² = 1 + d·x²·y², doubling gives y' = (y² + x²) / (2 − y² + x²).
    Y = (Y2 * xDen + xNum * Z2) % P;
    Z = ((((2n * Z2 - Y2 + P) % P) * xDen) % P + xNum * Z2) % P;
  }
  return Z === 0n || (Y - Z) % P === 0n;
}

const verifyingKeys = new Map<string, Promise<CryptoKey>>();

function verifyingKey(publicKey: string, raw: Bytes): Promise<CryptoKey> {
  let key = verifyingKeys.get(publicKey);
  if (!key) {
    key = crypto.subtle.importKey("raw", raw, { name: "Ed25519" }, false, ["verify"]);
    verifyingKeys.set(publicKey, key);
    if (verifyingKeys.size > KEY_CACHE_CAP) verifyingKeys.delete(verifyingKeys.keys().next().value!);
  }
  return key;
}

/**
 * Strict Ed25519 verification, equivalent to ed25519-dalek's verify_strict.
 * Returns null when the signature is good, else the reason it is not.
 */
export async function verifyDetached(publicKey: string, signature: string, signed: Bytes): Promise<string | null> {
  let key: Bytes, sig: Bytes;
  try {
    key = decodeKey(publicKey, "public key");
    sig = b64urlDecode(signature, 64, "signature");
  } catch (e) {
    return (e as Error).message;
  }
  if (hasSmallOrder(key)) return "public key is a small-order point";
  if (hasSmallOrder(sig.subarray(0, 32))) return "signature R is a small-order point";
  if (littleEndianToBigInt(sig.subarray(32)) >= L) return "signature S is not reduced (S >= L)";
  try {
    const ok = await crypto.subtle.verify("Ed25519", await verifyingKey(publicKey, key), sig, signed);
    return ok ? null : "signature does not match";
  } catch {
    verifyingKeys.delete(publicKey);
    return "public key is not a valid Ed25519 point";
  }
}

export const verifyMessage = (m: SignedMessage): Promise<string | null> =>
  verifyDetached(m.from, m.sig, canonicalBytes(m));

export const verifyAnnouncement = (a: Announcement): Promise<string | null> =>
  verifyDetached(a.pubkey, a.sig, announcementBytes(a));

/** A node's own key pair. The seed never leaves this object except into the key file. */
export interface Identity {
  readonly publicKey: string;
  readonly fingerprint: string;
  sign(bytes: Bytes): Promise<string>;
}

/** PKCS#8 wrapper for a raw 32-byte Ed25519 seed (RFC 8410), the only import form WebCrypto takes. */
const PKCS8_ED25519_PREFIX = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];

export async function identityFromSeed(seed: Uint8Array): Promise<Identity> {
  if (seed.length !== 32) throw new FormatError("an Ed25519 seed is 32 bytes");
  const pkcs8 = new Uint8Array([...PKCS8_ED25519_PREFIX, ...seed]);
  const exportable = await crypto.subtle.importKey("pkcs8", pkcs8, { name: "Ed25519" }, true, ["sign"]);
  const publicKey = (await crypto.subtle.exportKey("jwk", exportable)).x!;
  const signingKey = await crypto.subtle.importKey("pkcs8", pkcs8, { name: "Ed25519" }, false, ["sign"]);
  return {
    publicKey,
    fingerprint: fingerprint(publicKey),
    sign: async (bytes) => b64urlEncode(new Uint8Array(await crypto.subtle.sign("Ed25519", signingKey, bytes))),
  };
}

export const newMsgId = (): string => Buffer.from(crypto.getRandomValues(new Uint8Array(16))).toString("hex");

/** The fields a sender chooses; `from`, `ts`, `msg_id` and `sig` are filled in by signMessage. */
export interface Draft {
  to: string;
  text: string;
  kind?: Kind;
  task_id?: string;
  status?: TaskStatus;
  in_reply_to?: string;
  msg_id?: string;
}

export async function signMessage(id: Identity, draft: Draft, nowMs: number): Promise<SignedMessage> {
  const unsigned: Omit<SignedMessage, "sig"> = {
    from: id.publicKey,
    to: draft.to,
    text: draft.text,
    ts: nowMs,
    msg_id: draft.msg_id ?? newMsgId(),
    kind: draft.kind ?? "message",
    ...(draft.task_id ? { task_id: draft.task_id } : {}),
    ...(draft.status ? { status: draft.status } : {}),
    ...(draft.in_reply_to ? { in_reply_to: draft.in_reply_to } : {}),
  };
  return { ...unsigned, sig: await id.sign(canonicalBytes(unsigned)) };
}

export async function signAnnouncement(id: Identity, name: string, nowMs: number): Promise<Announcement> {
  const unsigned = { pubkey: id.publicKey, name, ts: nowMs };
  return { ...unsigned, sig: await id.sign(announcementBytes(unsigned)) };
}

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);

function field(o: Record<string, unknown>, name: string): string {
  const v = o[name];
  if (typeof v !== "string") throw new FormatError(`"${name}" is ${v === undefined ? "missing" : "not a string"}`);
  return v;
}

/** Optional string field: absent, null or "" all mean none (the signature cannot tell them apart). */
function optionalField(o: Record<string, unknown>, name: string): string | undefined {
  const v = o[name];
  if (v === undefined || v === null || v === "") return undefined;
  if (typeof v !== "string") throw new FormatError(`"${name}" is not a string`);
  return v;
}

function timestamp(o: Record<string, unknown>, name: string): number {
  const v = o[name];
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
    throw new FormatError(`"${name}" is not a non-negative integer of unix milliseconds`);
  }
  return v;
}

export function isTaskStatus(v: unknown): v is TaskStatus {
  return (STATUSES as readonly unknown[]).includes(v);
}

/** Parses untrusted JSON into a SignedMessage or throws a FormatError naming the first problem. */
export function parseSignedMessage(value: unknown): SignedMessage {
  if (!isObject(value)) throw new FormatError("message is not a JSON object");
  const kind = value.kind ?? "message";
  if (!(KINDS as readonly unknown[]).includes(kind)) {
    throw new FormatError(`unknown kind ${JSON.stringify(kind)} (expected ${KINDS.join(", ")})`);
  }
  const status = value.status ?? undefined;
  if (status !== undefined && !isTaskStatus(status)) {
    throw new FormatError(`unknown status ${JSON.stringify(status)} (expected ${STATUSES.join(", ")})`);
  }
  const msg: SignedMessage = {
    from: field(value, "from"),
    to: field(value, "to"),
    text: field(value, "text"),
    ts: timestamp(value, "ts"),
    msg_id: field(value, "msg_id"),
    kind: kind as Kind,
    sig: field(value, "sig"),
  };
  decodeKey(msg.from, "from");
  decodeKey(msg.to, "to");
  b64urlDecode(msg.sig, 64, "sig");
  if (msg.msg_id === "") throw new FormatError(`"msg_id" is empty`);
  const task_id = optionalField(value, "task_id");
  const in_reply_to = optionalField(value, "in_reply_to");
  if (task_id !== undefined) msg.task_id = task_id;
  if (status !== undefined) msg.status = status;
  if (in_reply_to !== undefined) msg.in_reply_to = in_reply_to;
  return msg;
}

export function parseAnnouncement(value: unknown): Announcement {
  if (!isObject(value)) throw new FormatError("announcement is not a JSON object");
  const a = { pubkey: field(value, "pubkey"), name: field(value, "name"), ts: timestamp(value, "ts"), sig: field(value, "sig") };
  decodeKey(a.pubkey, "pubkey");
  b64urlDecode(a.sig, 64, "sig");
  return a;
}

// ============================================================================
// The gate
// ============================================================================

/**
 * Message ids already admitted, keyed by sender so one peer cannot burn
 * another's ids. Bounded by time: an entry older than the freshness window is
 * forgotten, because freshness alone rejects a replay of it. The agent rebuilds
 * it from its log at start, so a replay after a restart is still refused.
 */
export class ReplayMemory {
  #seen = new Map<string, number>(); // "<sender> <msg_id>" → message ts, in admission order
  #evicted = 0;

  constructor(readonly cap = REPLAY_CAP) {}

  get size(): number {
    return this.#seen.size;
  }

  /** Entries pushed out by the cap while still fresh; nonzero means replays of those could pass. */
  get evicted(): number {
    return this.#evicted;
  }

  has(sender: string, msgId: string): boolean {
    return this.#seen.has(`${sender} ${msgId}`);
  }

  remember(sender: string, msgId: string, ts: number, nowMs: number): void {
    const key = `${sender} ${msgId}`;
    this.#seen.delete(key);
    this.#seen.set(key, ts);
    this.forget(nowMs);
  }

  /** Drops expired entries from the front (admission order roughly follows ts), then enforces the cap. */
  forget(nowMs: number): void {
    for (const [key, ts] of this.#seen) {
      if (ts >= nowMs - FRESH_PAST_MS) break;
      this.#seen.delete(key);
    }
    while (this.#seen.size > this.cap) {
      this.#seen.delete(this.#seen.keys().next().value!);
      this.#evicted++;
    }
  }
}

/** A claimed name for display: control characters and markup stripped, bounded. Never used for identity. */
export function displayName(claimed: string): string {
  const clean = claimed
    .replace(/[\u0000-\u001f\u007f-\u009f\u2028\u2029]+/g, " ")
    .replace(/[<>"'`&\\[\]]/g, "")
    .replace(/\s+/g, " ")
    .trim()
    .slice(0, 64);
  return clean || "(no name)";
}

/**
 * The inbound gate (SPEC "Inbound gate"), a pure function of its arguments:
 * every payload drained from a bus goes through it before the model sees
 * anything, and the steps run in this order:
 *   1. parse  2. verify (the authenticated key is the sender)  3. addressed to us
 *   4. allowlisted, except a stranger's knock or accept  5. fresh  6. not a replay
 *   7. dispatch: a peer's message is delivered, a knock is held for the operator,
 *      an accept counts only if we knocked that key.
 * The caller records admitted messages in `replay` (and its log) afterwards.
 */
export async function decide(
  payload: unknown,
  me: string,
  peers: Peers,
  nowMs: number,
  replay: ReplayMemory,
  knocked: ReadonlySet<string> = new Set(),
): Promise<Verdict> {
  let msg: SignedMessage;
  try {
    msg = parseSignedMessage(payload);
  } catch (e) {
    return { verdict: "reject", reason: "malformed", detail: (e as Error).message };
  }
  const bad = await verifyMessage(msg);
  if (bad) return { verdict: "reject", reason: "bad_signature", detail: bad, msg };
  if (msg.to !== me) return { verdict: "reject", reason: "wrong_recipient", detail: `addressed to ${fingerprint(msg.to)}`, msg };
  const petname = peers.byKey.get(msg.from);
  if (petname === undefined && msg.kind === "message") {
    return { verdict: "reject", reason: "not_allowlisted", detail: `${fingerprint(msg.from)} is not in peers.json`, msg };
  }
  if (msg.ts - nowMs > FRESH_FUTURE_MS) {
    return { verdict: "reject", reason: "stale", detail: `ts is ${msg.ts - nowMs} ms in the future`, msg };
  }
  if (nowMs - msg.ts > FRESH_PAST_MS) {
    return { verdict: "reject", reason: "stale", detail: `ts is ${Math.round((nowMs - msg.ts) / 60_000)} min old`, msg };
  }
  if (replay.has(msg.from, msg.msg_id)) return { verdict: "reject", reason: "replay", detail: `msg_id ${msg.msg_id} already admitted`, msg };
  switch (msg.kind) {
    case "message":
      return { verdict: "deliver", msg, petname: petname! };
    case "pair_request":
      return { verdict: "pair_request", msg, claimedName: displayName(msg.text) };
    case "pair_accept":
      return knocked.has(msg.from)
        ? { verdict: "pair_accept", msg }
        : { verdict: "reject", reason: "unexpected_kind", detail: "pair_accept without a knock from us", msg };
  }
}

// ============================================================================
// Task folding
// ============================================================================

export type Side = "me" | "peer";

/** One delegated task as both ends see it, folded from the messages that carry its task_id. */
export interface TaskRow {
  task_id: string;
  peer_key: string;
  requested_by: Side;
  status: TaskStatus | null;
  last_msg_id: string;
  last_at: number;
  /** needs_input questions not yet answered with in_reply_to, and who asked them. */
  awaiting: { msg_id: string; asked_by: Side }[];
  closed: boolean;
  messages: number;
}

/** Tasks are per counterpart: two peers may both use task_id "t1". */
export const taskKey = (peerKey: string, taskId: string): string => `${peerKey} ${taskId}`;

/**
 * Folds one message into the task table. `dir` is "out" for messages we sent.
 * A terminal status closes the task; anything after it is counted but cannot
 * reopen it. Pure apart from mutating `tasks`.
 */
export function foldTask(tasks: Map<string, TaskRow>, dir: "in" | "out", msg: SignedMessage, atMs: number): void {
  if (msg.kind !== "message" || !msg.task_id) return;
  const peerKey = dir === "out" ? msg.to : msg.from;
  const side: Side = dir === "out" ? "me" : "peer";
  const key = taskKey(peerKey, msg.task_id);
  let row = tasks.get(key);
  if (!row) {
    row = { task_id: msg.task_id, peer_key: peerKey, requested_by: side, status: null, last_msg_id: "", last_at: 0, awaiting: [], closed: false, messages: 0 };
    tasks.set(key, row);
  }
  row.messages++;
  row.last_msg_id = msg.msg_id;
  row.last_at = atMs;
  if (row.closed) return;
  if (msg.in_reply_to) row.awaiting = row.awaiting.filter((q) => !(q.msg_id === msg.in_reply_to && q.asked_by !== side));
  if (msg.status) row.status = msg.status;
  if (msg.status === "needs_input") row.awaiting.push({ msg_id: msg.msg_id, asked_by: side });
  if (msg.status && TERMINAL_STATUSES.has(msg.status)) {
    row.closed = true;
    row.awaiting = [];
  }
}

/** Why sending `draft` would break a task's lifecycle, or null if it may be sent. */
export function lifecycleError(tasks: ReadonlyMap<string, TaskRow>, draft: Draft): string | null {
  if (draft.status && !draft.task_id) return "status needs a task_id: task fields describe a task, and a chat message has none";
  if (!draft.task_id) return null;
  const row = tasks.get(taskKey(draft.to, draft.task_id));
  if (row?.closed) {
    return `task "${draft.task_id}" is closed (last status: ${row.status}); follow-up work needs a new task_id`;
  }
  return null;
}

// ============================================================================
// JSONL storage
// ============================================================================
//
// One tagged JSON object per line ({"t": ...}), append-only. Each append is a
// single write() on an O_APPEND descriptor, so concurrent appenders never
// interleave within a line. A line that is not JSON (a hand edit, or the torn
// tail of a write cut short by a crash) is skipped with a warning and never
// costs the lines around it. Compaction writes a temp file, fsyncs it and
// renames it over the original.
//
// fsync policy: `append` returns once the bytes are in the kernel, which is
// enough to survive the process being killed; `sync` adds an fdatasync shared
// by every append waiting at that moment (group commit), for what must survive
// a power cut: the bus before it answers 202, the agent before it answers a
// send or acks an inbound message.

export type JsonlRecord = Record<string, unknown> & { t: string };

export interface ScanResult {
  /** Byte offset just past the last complete line: where the next scan resumes. */
  next: number;
  /** Bytes after the last newline: a torn tail after a crash, or a write still in flight. */
  tornBytes: number;
}

/**
 * Reads complete lines from `from` to the end, calling `onRecord` for each good
 * record and `onSkip` for each bad line. Streams in 1 MiB chunks, so recovery
 * memory is the records kept, not the file size.
 */
export function scanJsonl(
  file: string,
  from: number,
  onRecord: (record: JsonlRecord, offset: number) => void,
  onSkip: (offset: number, reason: string) => void = () => {},
): ScanResult {
  let fd: number;
  try {
    fd = fs.openSync(file, "r");
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ENOENT") return { next: from, tornBytes: 0 };
    throw e;
  }
  try {
    const chunk = Buffer.allocUnsafe(1 << 20);
    let carry: Buffer | null = null;
    let readAt = from;
    let lineAt = from;
    for (;;) {
      const n = fs.readSync(fd, chunk, 0, chunk.length, readAt);
      if (n === 0) break;
      readAt += n;
      const buf: Buffer = carry ? Buffer.concat([carry, chunk.subarray(0, n)]) : chunk.subarray(0, n);
      let start = 0;
      for (let nl = buf.indexOf(10, start); nl !== -1; nl = buf.indexOf(10, start)) {
        const line = buf.toString("utf8", start, nl);
        if (line.trim() !== "") {
          let record: unknown;
          try {
            record = JSON.parse(line);
          } catch (e) {
            onSkip(lineAt, `not JSON (${(e as Error).message})`);
          }
          if (record !== undefined) {
            if (isObject(record) && typeof record.t === "string") onRecord(record as JsonlRecord, lineAt);
            else onSkip(lineAt, `not a tagged record`);
          }
        }
        lineAt += nl - start + 1;
        start = nl + 1;
      }
      carry = start < buf.length ? Buffer.from(buf.subarray(start)) : null;
    }
    return { next: lineAt, tornBytes: carry?.length ?? 0 };
  } finally {
    fs.closeSync(fd);
  }
}

/** The records of a whole file, warning on stderr about skipped and torn lines. */
export function readJsonl(file: string, warn: (msg: string) => void = logWarn): JsonlRecord[] {
  const records: JsonlRecord[] = [];
  const { tornBytes } = scanJsonl(file, 0, (r) => records.push(r), (at, why) => warn(`${file}: skipped the line at byte ${at}: ${why}`));
  if (tornBytes) warn(`${file}: skipped a torn last line (${tornBytes} bytes, a write cut short by a crash)`);
  return records;
}

/** An append handle on one JSONL file, with group-committed fdatasync. */
export class JsonlWriter {
  #fd: number;
  #waiters: { resolve(): void; reject(e: unknown): void }[] = [];
  #syncing = false;
  #retired: number[] = []; // descriptors replaced by compaction, closed once no sync is in flight

  constructor(readonly file: string) {
    this.#fd = fs.openSync(file, fs.constants.O_WRONLY | fs.constants.O_APPEND | fs.constants.O_CREAT, 0o600);
    // A crash mid-write leaves a last line without its newline; terminate it so
    // our next record starts on a line of its own and the fragment stays
    // skippable instead of swallowing that record.
    const size = fs.fstatSync(this.#fd).size;
    if (size > 0) {
      const last = Buffer.alloc(1);
      const rfd = fs.openSync(file, "r");
      try {
        fs.readSync(rfd, last, 0, 1, size - 1);
      } finally {
        fs.closeSync(rfd);
      }
      if (last[0] !== 10) {
        logWarn(`${file}: the last line was torn by a crash; it is kept apart and skipped`);
        this.#write("\n");
      }
    }
  }

  #write(text: string): void {
    const bytes = Buffer.from(text);
    let done = 0;
    while (done < bytes.length) done += fs.writeSync(this.#fd, bytes, done, bytes.length - done);
  }

  /** Appends records as one write: visible to readers and safe from a process kill when this returns. */
  append(records: readonly object[]): void {
    if (records.length) this.#write(records.map((r) => JSON.stringify(r) + "\n").join(""));
  }

  /** Resolves when everything appended so far is on stable storage. */
  sync(): Promise<void> {
    return new Promise((resolve, reject) => {
      this.#waiters.push({ resolve, reject });
      if (!this.#syncing) void this.#runSyncs();
    });
  }

  async appendDurable(records: readonly object[]): Promise<void> {
    this.append(records);
    await this.sync();
  }

  async #runSyncs(): Promise<void> {
    this.#syncing = true;
    while (this.#waiters.length) {
      const batch = this.#waiters.splice(0);
      const fd = this.#fd;
      try {
        await new Promise<void>((res, rej) => fs.fdatasync(fd, (e) => (e ? rej(e) : res())));
        for (const w of batch) w.resolve();
      } catch (e) {
        for (const w of batch) w.reject(e);
      }
    }
    this.#syncing = false;
    for (const fd of this.#retired.splice(0)) fs.closeSync(fd);
  }

  /** Replaces the file with exactly `records`: temp file, fsync, rename, then append to the new file. */
  compact(records: readonly object[]): void {
    const tmp = `${this.file}.${process.pid}.tmp`;
    writeFileDurably(tmp, records.map((r) => JSON.stringify(r) + "\n").join(""));
    fs.renameSync(tmp, this.file);
    syncDirectory(path.dirname(this.file));
    const old = this.#fd;
    this.#fd = fs.openSync(this.file, fs.constants.O_WRONLY | fs.constants.O_APPEND, 0o600);
    if (this.#syncing) this.#retired.push(old);
    else fs.closeSync(old);
  }

  close(): void {
    fs.closeSync(this.#fd);
  }
}

function writeFileDurably(file: string, text: string, mode = 0o600): void {
  const fd = fs.openSync(file, "w", mode);
  try {
    fs.writeSync(fd, text);
    fs.fsyncSync(fd);
  } finally {
    fs.closeSync(fd);
  }
}

function syncDirectory(dir: string): void {
  try {
    const fd = fs.openSync(dir, "r");
    try {
      fs.fsyncSync(fd);
    } finally {
      fs.closeSync(fd);
    }
  } catch {
    // Some filesystems refuse fsync on a directory; the rename is still atomic.
  }
}

/** Writes a small state file atomically (temp + rename), 0600 from creation. */
export function writeFileAtomic(file: string, text: string): void {
  const tmp = `${file}.${process.pid}.${Date.now()}.tmp`;
  writeFileDurably(tmp, text);
  fs.renameSync(tmp, file);
  syncDirectory(path.dirname(file));
}

export class LockedError extends InterlinkError {}

interface LockOwner {
  pid: number;
  role: string;
  since: number;
}

function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === "EPERM"; // alive, but another user's
  }
}

function readLockFile(file: string): { text: string; owner: LockOwner } | null {
  let text: string;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch {
    return null;
  }
  try {
    const owner = JSON.parse(text);
    if (isObject(owner) && Number.isSafeInteger(owner.pid)) return { text, owner: owner as unknown as LockOwner };
  } catch {
    // a lock file torn by a crash between create and write: nobody holds it
  }
  return { text, owner: { pid: 0, role: "unknown", since: 0 } };
}

/** The live process holding a lock file, or null if it is free or its owner is dead. */
export function lockOwner(file: string): LockOwner | null {
  const held = readLockFile(file);
  return held && held.owner.pid > 0 && pidAlive(held.owner.pid) ? held.owner : null;
}

/**
 * A lock file holding its owner's pid, created with O_EXCL. A lock whose pid is
 * dead is taken over: it is removed only if it still holds the text we judged
 * stale, so a lock that changed hands meanwhile is left alone (what remains is
 * the microseconds between that re-read and the unlink).
 */
export class PidLock {
  private constructor(readonly file: string, readonly content: string) {}

  static async acquire(file: string, role: string, waitMs = 0): Promise<PidLock> {
    const content = JSON.stringify({ pid: process.pid, role, since: Date.now() });
    const deadline = Date.now() + waitMs;
    for (;;) {
      try {
        const fd = fs.openSync(file, "wx", 0o600);
        fs.writeSync(fd, content);
        fs.closeSync(fd);
        return new PidLock(file, content);
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e;
      }
      const held = readLockFile(file);
      if (held === null) continue; // released between our create and our read
      const { pid, role: holder } = held.owner;
      if (pid > 0 && pidAlive(pid)) {
        if (Date.now() < deadline) {
          await sleep(25);
          continue;
        }
        throw new LockedError(`${file} is held by ${holder} (pid ${pid}); stop that process first, or use another folder`);
      }
      if (readLockFile(file)?.text === held.text) {
        try {
          fs.unlinkSync(file);
          logInfo(`took over ${file} from dead pid ${pid}`);
        } catch {
          // someone else removed it first; retry the create
        }
      }
    }
  }

  release(): void {
    if (readLockFile(this.file)?.text !== this.content) return;
    try {
      fs.unlinkSync(this.file);
    } catch {
      // already gone
    }
  }
}

/** Runs `fn` while holding a short-lived lock beside `file`. */
export async function withFileLock<T>(file: string, role: string, fn: () => T | Promise<T>): Promise<T> {
  const lock = await PidLock.acquire(`${file}.lock`, role, SHORT_LOCK_WAIT_MS);
  try {
    return await fn();
  } finally {
    lock.release();
  }
}

// ============================================================================
// The allowlist (peers.json)
// ============================================================================

export const EMPTY_PEERS: Peers = { byName: new Map(), byKey: new Map() };

export function checkPetname(name: unknown): string {
  if (typeof name !== "string" || !PETNAME_RE.test(name)) {
    throw new InterlinkError(
      `petname ${JSON.stringify(name)} is not valid: use 1-64 letters, digits or . _ @ + - (starting with a letter or digit)`,
    );
  }
  return name;
}

/** Checks a key a person typed or pasted: canonical, 32 bytes, not a small-order point. */
export function checkPeerKey(key: unknown, what: string): string {
  let raw: Uint8Array;
  try {
    raw = decodeKey(key, what);
  } catch (e) {
    throw new InterlinkError(`${(e as Error).message} (a public key is 43 base64url characters, as printed by \`interlink.ts id\`)`);
  }
  if (hasSmallOrder(raw)) throw new InterlinkError(`${what} is a small-order point, which would accept forged signatures`);
  return key as string;
}

/** Validates peers.json text (SPEC "Identity"); errors name the file, the petname and the problem. */
export function parsePeers(text: string, source = "peers.json"): Peers {
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch (e) {
    throw new InterlinkError(`Cannot parse ${source}: not JSON (${(e as Error).message})`);
  }
  if (!isObject(raw)) throw new InterlinkError(`Cannot parse ${source}: expected an object of { "<petname>": { "key": "<public key>" } }`);
  const byName = new Map<string, string>();
  const byKey = new Map<string, string>();
  for (const [name, entry] of Object.entries(raw)) {
    try {
      checkPetname(name);
      if (!isObject(entry)) throw new InterlinkError(`entry is not an object with a "key"`);
      const key = checkPeerKey(entry.key, "key");
      const other = byKey.get(key);
      if (other !== undefined) throw new InterlinkError(`holds the same key as '${other}' (one key, one petname)`);
      byName.set(name, key);
      byKey.set(key, name);
    } catch (e) {
      throw new InterlinkError(`Cannot parse ${source}: '${name}': ${(e as Error).message}`);
    }
  }
  return { byName, byKey };
}

/** Loads peers.json; a missing file is an empty allowlist (pairing will create it). */
export function loadPeers(file: string): Peers {
  let text: string;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ENOENT") return EMPTY_PEERS;
    throw new InterlinkError(`Cannot read ${file}: ${(e as Error).message}`);
  }
  return parsePeers(text, file);
}

/**
 * Adds a peer under the no-rekey rules: a petname never silently changes key,
 * and a key never gets a second petname. Re-adding the same pair is a no-op.
 * Unknown fields in peers.json are kept. Returns what happened, for the caller to report.
 */
export async function addPeer(file: string, petname: string, key: string): Promise<"added" | "unchanged"> {
  checkPetname(petname);
  checkPeerKey(key, "key");
  return await withFileLock(file, "peers edit", () => {
    const raw = readPeersObject(file);
    const peers = parsePeers(JSON.stringify(raw), file);
    const held = peers.byName.get(petname);
    if (held === key) return "unchanged";
    if (held !== undefined) {
      throw new InterlinkError(`'${petname}' already holds key ${fingerprint(held)}…; refusing to rekey it silently (remove it first if the peer really changed keys)`);
    }
    const other = peers.byKey.get(key);
    if (other !== undefined) throw new InterlinkError(`key ${fingerprint(key)}… is already in peers.json as '${other}'`);
    raw[petname] = { key };
    writePeersObject(file, raw);
    return "added";
  });
}

export async function removePeer(file: string, petname: string): Promise<string> {
  return await withFileLock(file, "peers edit", () => {
    const raw = readPeersObject(file);
    const peers = parsePeers(JSON.stringify(raw), file);
    const key = peers.byName.get(petname);
    if (key === undefined) {
      throw new InterlinkError(`no peer named '${petname}' (peers: ${[...peers.byName.keys()].join(", ") || "none"})`);
    }
    delete raw[petname];
    writePeersObject(file, raw);
    return key;
  });
}

function readPeersObject(file: string): Record<string, unknown> {
  try {
    const raw = JSON.parse(fs.readFileSync(file, "utf8"));
    if (!isObject(raw)) throw new InterlinkError(`Cannot parse ${file}: expected an object`);
    return raw;
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ENOENT") return {};
    if (e instanceof InterlinkError) throw e;
    throw new InterlinkError(`Cannot parse ${file}: ${(e as Error).message}`);
  }
}

function writePeersObject(file: string, raw: Record<string, unknown>): void {
  fs.mkdirSync(path.dirname(file), { recursive: true, mode: 0o700 });
  writeFileAtomic(file, JSON.stringify(raw, null, 2) + "\n");
}

// ============================================================================
// The bus
// ============================================================================
//
// A dumb relay (SPEC "Bus HTTP API"): it routes opaque JSON to a recipient
// string, verifies nothing, holds no keys, and keeps each message until its
// recipient acks it. Its state is one JSONL file in the data folder:
//   {"t":"m","q":<recipient>,"n":<seq>,"ts":<ms>,"p":<payload as JSON text>}  accepted
//   {"t":"a","q":<recipient>,"n":<seq>}                                       acked
//   {"t":"d","q":<recipient>,"n":<seq>}                                       dropped by the cap
//   {"t":"h","next":<seq>}                                                    first line after compaction
// `seq` is global and never reused (compaction keeps the high-water mark), so
// an ack key handed out before a restart still names the same message after it.
// Payloads stay JSON text end to end: the bus never parses what it relays.

interface Queued {
  seq: number;
  ts: number;
  payload: string;
  gone: boolean;
}

/** One recipient's FIFO, in seq order. Acked entries are marked and skipped; the array is trimmed as the head advances. */
class RecipientQueue {
  items: Queued[] = [];
  head = 0;
  live = 0;

  first(): Queued | undefined {
    while (this.head < this.items.length && this.items[this.head].gone) this.head++;
    if (this.head > 1024 && this.head * 2 > this.items.length) {
      this.items = this.items.slice(this.head);
      this.head = 0;
    }
    return this.items[this.head];
  }

  /** Marks `seq` gone; binary search, since acks may name any entry, not only the head. */
  remove(seq: number): Queued | undefined {
    let lo = this.head, hi = this.items.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      const item = this.items[mid];
      if (item.seq === seq) {
        if (item.gone) return undefined;
        item.gone = true;
        this.live--;
        return item;
      }
      if (item.seq < seq) lo = mid + 1;
      else hi = mid - 1;
    }
    return undefined;
  }
}

/**
 * The queue logic of the bus, with no I/O: one bounded FIFO per recipient.
 * Memory is proportional to what is held: a queue is deleted when it empties.
 */
export class BusQueues {
  #queues = new Map<string, RecipientQueue>();
  nextSeq = 1;
  liveCount = 0;

  constructor(readonly cap = QUEUE_CAP) {}

  get recipientCount(): number {
    return this.#queues.size;
  }

  /** Appends a message; returns the entry dropped to stay within the cap, if any. */
  add(to: string, ts: number, payload: string, seq = this.nextSeq): { item: Queued; dropped?: Queued } {
    let q = this.#queues.get(to);
    if (!q) this.#queues.set(to, (q = new RecipientQueue()));
    const item = { seq, ts, payload, gone: false };
    q.items.push(item);
    q.live++;
    this.liveCount++;
    this.nextSeq = Math.max(this.nextSeq, seq + 1);
    let dropped: Queued | undefined;
    if (q.live > this.cap) {
      dropped = q.first()!;
      this.remove(to, dropped.seq);
    }
    return { item, dropped };
  }

  /** The oldest un-acked message for `to`; it stays there until acked. */
  first(to: string): Queued | undefined {
    return this.#queues.get(to)?.first();
  }

  remove(to: string, seq: number): boolean {
    const q = this.#queues.get(to);
    if (!q?.remove(seq)) return false;
    this.liveCount--;
    if (q.live === 0) this.#queues.delete(to);
    return true;
  }

  /** Every live message, per recipient in seq order (what compaction keeps). */
  *live(): Generator<[string, Queued]> {
    for (const [to, q] of this.#queues) {
      for (let i = q.head; i < q.items.length; i++) if (!q.items[i].gone) yield [to, q.items[i]];
    }
  }
}

/** Presence claims as posted, unverified (clients verify); bounded in count and age. */
export class Roster {
  #entries = new Map<string, { json: string; at: number }>();

  constructor(readonly cap = ROSTER_CAP, readonly ttlMs = ROSTER_TTL_MS) {}

  put(pubkey: string, json: string, nowMs: number): void {
    this.#entries.delete(pubkey); // re-insert at the back: the map's order is freshness order
    this.#entries.set(pubkey, { json, at: nowMs });
    while (this.#entries.size > this.cap) this.#entries.delete(this.#entries.keys().next().value!);
  }

  list(nowMs: number): string[] {
    for (const [key, e] of this.#entries) {
      if (nowMs - e.at < this.ttlMs) break;
      this.#entries.delete(key);
    }
    return [...this.#entries.values()].map((e) => e.json);
  }
}

class HttpError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
  }
}

const jsonResponse = (status: number, body: string, headers: Record<string, string> = {}): Response =>
  new Response(body, { status, headers: { "content-type": "application/json", ...headers } });

const errorResponse = (status: number, message: string): Response => jsonResponse(status, JSON.stringify({ error: message }));

/** Reads a JSON body of at most BODY_LIMIT_BYTES, counting bytes as they arrive (Content-Length may be absent or lie). */
async function readJsonBody(req: Request): Promise<unknown> {
  const declared = Number(req.headers.get("content-length") ?? "0");
  if (declared > BODY_LIMIT_BYTES) throw new HttpError(413, `body over ${BODY_LIMIT_BYTES} bytes`);
  if (!req.body) throw new HttpError(400, "empty body; expected JSON");
  const reader = req.body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.length;
    if (size > BODY_LIMIT_BYTES) {
      await reader.cancel().catch(() => {});
      throw new HttpError(413, `body over ${BODY_LIMIT_BYTES} bytes`);
    }
    chunks.push(value);
  }
  try {
    return JSON.parse(Buffer.concat(chunks).toString("utf8"));
  } catch (e) {
    throw new HttpError(400, `body is not JSON (${(e as Error).message})`);
  }
}

function recipientParam(value: unknown, name: string): string {
  if (typeof value !== "string" || value === "") throw new HttpError(400, `"${name}" must be a non-empty string`);
  if (value.length > RECIPIENT_MAX_CHARS) throw new HttpError(400, `"${name}" is longer than ${RECIPIENT_MAX_CHARS} characters`);
  // Ack keys are `recipient + "\0" + seq`; a NUL inside a recipient would let "a" ack the messages of "a\0x".
  if (value.includes("\0")) throw new HttpError(400, `"${name}" must not contain NUL`);
  return value;
}

/** Largest announcement kept: a real one is ~200 bytes, and the roster holds ROSTER_CAP of them. */
const ANNOUNCEMENT_MAX_BYTES = 4096;

export interface BusOptions {
  cap?: number;
  log?: (msg: string) => void;
  now?: () => number;
}

/** The durable bus: BusQueues and Roster behind a Request → Response handler, on one JSONL file. */
export class Bus {
  readonly roster = new Roster();
  #waiters = new Map<string, Set<() => void>>();
  #syncScheduled = false;
  readonly #log: (msg: string) => void;
  readonly #now: () => number;

  private constructor(
    readonly dataDir: string,
    readonly queues: BusQueues,
    readonly recovery: RecoveryReport,
    private writer: JsonlWriter,
    private lock: PidLock,
    private dead: number, // records in the file that no longer describe a live message
    opts: BusOptions,
  ) {
    this.#log = opts.log ?? logInfo;
    this.#now = opts.now ?? Date.now;
  }

  /** Locks the data folder, replays the queue file and compacts it if it is mostly dead. */
  static async open(dataDir: string, opts: BusOptions = {}): Promise<Bus> {
    fs.mkdirSync(dataDir, { recursive: true, mode: 0o700 });
    const lock = await PidLock.acquire(path.join(dataDir, "bus.lock"), "interlink bus");
    try {
      const file = path.join(dataDir, "queue.jsonl");
      const started = performance.now();
      const queues = new BusQueues(opts.cap ?? QUEUE_CAP);
      let records = 0, skipped = 0, dropped = 0;
      const { tornBytes } = scanJsonl(file, 0, (r) => {
        records++;
        if (r.t === "h" && typeof r.next === "number") queues.nextSeq = Math.max(queues.nextSeq, r.next);
        else if (typeof r.q !== "string" || typeof r.n !== "number") skipped++;
        else if (r.t === "m" && typeof r.p === "string" && typeof r.ts === "number") {
          if (queues.add(r.q, r.ts, r.p, r.n).dropped) dropped++;
        } else if (r.t === "a" || r.t === "d") queues.remove(r.q, r.n);
        else skipped++;
      }, () => skipped++);
      const recovery = {
        messages: queues.liveCount,
        recipients: queues.recipientCount,
        skippedLines: skipped + (tornBytes ? 1 : 0),
        droppedByCap: dropped,
        ms: Math.round(performance.now() - started),
      };
      const bus = new Bus(dataDir, queues, recovery, new JsonlWriter(file), lock, records - queues.liveCount, opts);
      bus.#maybeCompact();
      return bus;
    } catch (e) {
      lock.release();
      throw e;
    }
  }

  /** Open long-polls right now (for tests and `bench`). */
  get waiterCount(): number {
    let n = 0;
    for (const set of this.#waiters.values()) n += set.size;
    return n;
  }

  readonly handler = async (req: Request): Promise<Response> => {
    const url = new URL(req.url);
    const route = BUS_ROUTES[url.pathname];
    if (!route) return errorResponse(404, `no route ${url.pathname}; the bus serves ${Object.keys(BUS_ROUTES).join(", ")}`);
    if (req.method !== route.method) {
      return new Response(JSON.stringify({ error: `${url.pathname} takes ${route.method}` }), {
        status: 405,
        headers: { allow: route.method, "content-type": "application/json" },
      });
    }
    try {
      return await route.handle(this, req, url);
    } catch (e) {
      if (e instanceof HttpError) return errorResponse(e.status, e.message);
      this.#log(`internal error on ${url.pathname}: ${(e as Error).stack ?? e}`);
      return errorResponse(500, "internal error; see the bus log");
    }
  };

  async send(to: string, payload: string): Promise<void> {
    const seq = this.queues.nextSeq++;
    const ts = this.#now();
    this.writer.append([{ t: "m", q: to, n: seq, ts, p: payload }]);
    await this.writer.sync(); // 202 means on disk: group commit shares this fsync with concurrent sends
    const { dropped } = this.queues.add(to, ts, payload, seq);
    if (dropped) {
      this.writer.append([{ t: "d", q: to, n: dropped.seq }]);
      this.dead += 2;
      this.#log(`queue for ${fingerprint(to)}${to.includes("#") ? to.slice(to.indexOf("#")) : ""} is over its cap of ${this.queues.cap}; dropped its oldest message (seq ${dropped.seq})`);
    }
    const waiting = this.#waiters.get(to);
    if (waiting) for (const wake of waiting) wake();
    this.#maybeCompact();
  }

  /** The oldest un-acked message for `me`, waiting up to `timeoutMs` for one to arrive. */
  async recv(me: string, timeoutMs: number, signal?: AbortSignal): Promise<Queued | undefined> {
    const ready = this.queues.first(me);
    if (ready || timeoutMs <= 0 || signal?.aborted) return ready;
    await new Promise<void>((resolve) => {
      let set = this.#waiters.get(me);
      if (!set) this.#waiters.set(me, (set = new Set()));
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
    return this.queues.first(me);
  }

  /** Acks are written before answering (they survive a crash of this process) and fsynced lazily: a lost ack only means a redelivery, which receivers dedupe. */
  ack(me: string, seq: number): void {
    if (!this.queues.remove(me, seq)) return;
    this.writer.append([{ t: "a", q: me, n: seq }]);
    this.dead += 2;
    this.#syncSoon();
    this.#maybeCompact();
  }

  #syncSoon(): void {
    if (this.#syncScheduled) return;
    this.#syncScheduled = true;
    setTimeout(() => {
      this.#syncScheduled = false;
      this.writer.sync().catch((e) => this.#log(`fsync failed: ${(e as Error).message}`));
    }, 50);
  }

  /** Rewrites the file to its live messages once dead records dominate, so disk use tracks what is held. */
  #maybeCompact(): void {
    if (this.dead < Math.max(COMPACT_MIN_DEAD, this.queues.liveCount)) return;
    const records: object[] = [{ t: "h", next: this.queues.nextSeq }];
    for (const [q, m] of this.queues.live()) records.push({ t: "m", q, n: m.seq, ts: m.ts, p: m.payload });
    this.writer.compact(records);
    this.dead = 0;
  }

  async close(): Promise<void> {
    for (const set of this.#waiters.values()) for (const wake of set) wake();
    await this.writer.sync().catch(() => {});
    this.writer.close();
    this.lock.release();
  }
}

export interface RecoveryReport {
  messages: number;
  recipients: number;
  skippedLines: number;
  droppedByCap: number;
  ms: number;
}

const ackKey = (me: string, seq: number) => `${me}\0${seq}`;

/** The long-poll wait a recv asks for: default when absent, clamped to RECV_TIMEOUT_MAX_MS. */
export function recvTimeoutMs(raw: string | null): number {
  if (raw === null || raw === "") return RECV_TIMEOUT_MS;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < 0) throw new HttpError(400, `timeout_ms must be a non-negative integer, got ${JSON.stringify(raw)}`);
  return Math.min(n, RECV_TIMEOUT_MAX_MS);
}

const BUS_ROUTES: Record<string, { method: string; handle(bus: Bus, req: Request, url: URL): Promise<Response> }> = {
  "/send": {
    method: "POST",
    async handle(bus, req) {
      const body = await readJsonBody(req);
      if (!isObject(body)) throw new HttpError(400, 'expected {"to": <recipient>, "payload": <any JSON>}');
      const to = recipientParam(body.to, "to");
      if (body.payload === undefined) throw new HttpError(400, '"payload" is missing');
      await bus.send(to, JSON.stringify(body.payload));
      return jsonResponse(202, '{"status":"queued"}');
    },
  },
  "/recv": {
    method: "GET",
    async handle(bus, req, url) {
      const me = recipientParam(url.searchParams.get("me"), "me");
      const m = await bus.recv(me, recvTimeoutMs(url.searchParams.get("timeout_ms")), req.signal);
      if (!m) return jsonResponse(200, '{"status":"timeout"}');
      return jsonResponse(200, `{"status":"message","envelope":{"payload":${m.payload},"ts":${m.ts}},"ack":${JSON.stringify(ackKey(me, m.seq))}}`);
    },
  },
  "/ack": {
    method: "POST",
    async handle(bus, req) {
      const body = await readJsonBody(req);
      if (!isObject(body)) throw new HttpError(400, 'expected {"me": <recipient>, "ack": <key>}');
      const me = recipientParam(body.me, "me");
      if (typeof body.ack !== "string") throw new HttpError(400, '"ack" must be a string');
      if (!body.ack.startsWith(me + "\0")) throw new HttpError(403, "that ack key belongs to another recipient");
      const seq = Number(body.ack.slice(me.length + 1));
      if (Number.isSafeInteger(seq)) bus.ack(me, seq); // unknown or already acked: still 200, acks are idempotent
      return jsonResponse(200, '{"status":"acked"}');
    },
  },
  "/announce": {
    method: "POST",
    async handle(bus, req) {
      const body = await readJsonBody(req);
      if (!isObject(body) || typeof body.pubkey !== "string" || body.pubkey === "") throw new HttpError(400, 'an announcement needs a "pubkey"');
      const json = JSON.stringify(body);
      if (json.length > ANNOUNCEMENT_MAX_BYTES) throw new HttpError(413, `announcement over ${ANNOUNCEMENT_MAX_BYTES} bytes`);
      bus.roster.put(body.pubkey, json, Date.now());
      return jsonResponse(202, '{"status":"announced"}');
    },
  },
  "/roster": {
    method: "GET",
    handle(bus) {
      return Promise.resolve(jsonResponse(200, `{"roster":[${bus.roster.list(Date.now()).join(",")}]}`));
    },
  },
};

export interface Listening {
  port: number;
  stop(): Promise<void>;
}

/** Binds a fetch handler to a TCP port with the host runtime's own server. */
export function serveHttp(handler: (req: Request) => Promise<Response>, hostname: string, port: number): Promise<Listening> {
  const { Bun, Deno } = runtimeHost;
  if (Bun) {
    // idleTimeout counts while a long-poll waits: keep it above RECV_TIMEOUT_MAX_MS.
    const server = Bun.serve({ hostname, port, idleTimeout: Math.ceil(RECV_TIMEOUT_MAX_MS / 1000) + 30, fetch: handler });
    return Promise.resolve({ port: server.port, stop: async () => server.stop(true) });
  }
  if (Deno) {
    return new Promise((resolve) => {
      const server = Deno.serve({ hostname, port, onListen: () => {} }, handler);
      resolve({ port: server.addr.port, stop: () => server.shutdown() });
    });
  }
  throw new InterlinkError("interlink.ts needs Bun or Deno to serve HTTP");
}

const isLoopback = (host: string) => host === "localhost" || host === "::1" || /^127\./.test(host);

// ============================================================================
// CLI
// ============================================================================
//
// One table describes every command and flag; parsing, INTERLINK_* env twins,
// defaults and --help are all generated from it, so the help cannot drift from
// what the code accepts. Precedence: flag, then env var, then default.

interface OptionSpec {
  type: "string" | "boolean";
  help: string;
  /** Placeholder shown in help for string options. */
  arg?: string;
  env?: string;
  default?: string | (() => string);
  short?: string;
}

type Options = Record<string, string | boolean | undefined>;

interface CommandSpec {
  summary: string;
  /** Positional arguments as shown in usage, e.g. "<peer> <text>". */
  args?: string;
  /** Longer explanation printed under the usage line. */
  about?: string;
  options: Record<string, OptionSpec>;
  run(opts: Options, positionals: string[]): Promise<number>;
}

const home = () => os.homedir();
const configDir = () => process.env.XDG_CONFIG_HOME || path.join(home(), ".config");
const stateDir = () => process.env.XDG_STATE_HOME || path.join(home(), ".local", "state");
const tildify = (p: string) => (p.startsWith(home() + path.sep) ? "~" + p.slice(home().length) : p);

const OPT = {
  key: { type: "string", arg: "PATH", env: "INTERLINK_KEY", default: () => path.join(configDir(), "interlink", "id.key"), help: "this node's secret key file" },
  peers: { type: "string", arg: "PATH", env: "INTERLINK_PEERS", default: () => path.join(configDir(), "interlink", "peers.json"), help: "the allowlist of peers" },
} satisfies Record<string, OptionSpec>;

/** Reads the key file: base64url of the 32-byte seed, surrounding whitespace ignored (the Rust keygen format). */
export async function readIdentity(file: string): Promise<Identity> {
  let text: string;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    const why = (e as NodeJS.ErrnoException).code === "ENOENT" ? "no such file" : (e as Error).message;
    throw new InterlinkError(`Cannot read key file ${file}: ${why}. Create one with \`interlink.ts keygen --out ${file}\`.`);
  }
  let seed: Uint8Array;
  try {
    seed = b64urlDecode(text.trim(), 32, "seed");
  } catch (e) {
    throw new InterlinkError(`Key file ${file} does not hold a base64url Ed25519 seed: ${(e as Error).message}`);
  }
  return await identityFromSeed(seed);
}

/** Creates a key file with mode 0600 in the same step (no window where it is readable by others). */
export function writeKeyFile(file: string, seed: Uint8Array, force: boolean): void {
  fs.mkdirSync(path.dirname(file), { recursive: true, mode: 0o700 });
  if (!force && fs.existsSync(file)) {
    throw new InterlinkError(`${file} already exists; refusing to overwrite an identity (pass --force to replace it)`);
  }
  const tmp = `${file}.${process.pid}.tmp`;
  const fd = fs.openSync(tmp, "wx", 0o600);
  try {
    fs.writeSync(fd, b64urlEncode(seed) + "\n");
    fs.fsyncSync(fd);
  } finally {
    fs.closeSync(fd);
  }
  if (force) fs.renameSync(tmp, file);
  else {
    // link() fails if the name appeared meanwhile, so a racing keygen never clobbers an identity.
    try {
      fs.linkSync(tmp, file);
    } finally {
      fs.unlinkSync(tmp);
    }
  }
}

function print(text = ""): void {
  process.stdout.write(text + "\n");
}

async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(Buffer.from(chunk));
  return Buffer.concat(chunks).toString("utf8");
}

/** One line of `interlink.ts verify` input: a signed message, a bus recv answer, or an announcement. */
export async function verifyLine(line: string): Promise<string> {
  let value: unknown;
  try {
    value = JSON.parse(line);
  } catch (e) {
    return `invalid: not JSON (${(e as Error).message})`;
  }
  if (isObject(value) && isObject(value.envelope) && "payload" in value.envelope) value = value.envelope.payload;
  try {
    if (isObject(value) && "pubkey" in value && !("from" in value)) {
      const a = parseAnnouncement(value);
      const bad = await verifyAnnouncement(a);
      return bad ? `invalid: ${bad}` : `ok ${a.pubkey}`;
    }
    const msg = parseSignedMessage(value);
    const bad = await verifyMessage(msg);
    return bad ? `invalid: ${bad}` : `ok ${msg.from}`;
  } catch (e) {
    return `invalid: ${(e as Error).message}`;
  }
}

function intOption(value: unknown, flag: string, min: number, max: number): number {
  const n = Number(value);
  if (typeof value !== "string" || !/^\d+$/.test(value) || n < min || n > max) {
    throw new InterlinkError(`--${flag} must be an integer from ${min} to ${max}, got ${JSON.stringify(value)}`);
  }
  return n;
}

/** Resolves with the signal's name on the first SIGINT or SIGTERM. */
function shutdownSignal(): Promise<string> {
  return new Promise((resolve) => {
    for (const sig of ["SIGINT", "SIGTERM"] as const) process.once(sig, () => resolve(sig));
  });
}

async function runBus(o: Options): Promise<number> {
  const host = o.host as string;
  const port = intOption(o.port, "port", 0, 65535);
  const cap = intOption(o.cap, "cap", 1, 10_000_000);
  const dataDir = o.data as string;
  logComponent = "interlink bus";
  const bus = await Bus.open(dataDir, { cap });
  let server: Listening;
  try {
    server = await serveHttp(bus.handler, host, port);
  } catch (e) {
    await bus.close();
    throw new InterlinkError(`cannot listen on ${host}:${port}: ${(e as Error).message}`);
  }
  const r = bus.recovery;
  logInfo(`listening on http://${host.includes(":") ? `[${host}]` : host}:${server.port} (data ${dataDir}, cap ${cap} per recipient)`);
  logInfo(`recovered ${r.messages} un-acked messages for ${r.recipients} recipients in ${r.ms} ms` + (r.skippedLines ? `; skipped ${r.skippedLines} unreadable lines` : "") + (r.droppedByCap ? `; dropped ${r.droppedByCap} over the cap` : ""));
  if (!isLoopback(host)) logWarn(`bound to ${host}, not loopback: anything that reaches this port can enqueue and read the roster (messages stay signed, not secret)`);
  const sig = await shutdownSignal();
  logInfo(`${sig}: shutting down`);
  await server.stop();
  await bus.close();
  return 0;
}

const COMMANDS: Record<string, CommandSpec> = {
  bus: {
    summary: "run the durable keep-until-ack relay that nodes talk through",
    about:
      "Speaks the interlink-bus HTTP API (POST /send, GET /recv, POST /ack, POST /announce,\n" +
      "GET /roster). A message answered 202 is on disk; it is delivered until its recipient acks it.",
    options: {
      host: { type: "string", arg: "HOST", env: "INTERLINK_BUS_HOST", default: "127.0.0.1", help: "address to bind (non-loopback prints a warning)" },
      port: { type: "string", arg: "PORT", env: "INTERLINK_BUS_PORT", default: String(DEFAULT_BUS_PORT), help: "TCP port; 0 picks a free one" },
      data: { type: "string", arg: "DIR", env: "INTERLINK_BUS_DATA", default: () => path.join(stateDir(), "interlink", "bus"), help: "folder for the queue file (one bus per folder)" },
      cap: { type: "string", arg: "N", env: "INTERLINK_QUEUE_CAP", default: String(QUEUE_CAP), help: "messages held per recipient before the oldest is dropped" },
    },
    run: runBus,
  },
  keygen: {
    summary: "create this node's Ed25519 key file",
    options: {
      out: { ...OPT.key, help: "where to write the key (0600)" },
      force: { type: "boolean", help: "replace an existing key file (the old identity is lost)" },
    },
    async run(o) {
      const file = o.out as string;
      const seed = crypto.getRandomValues(new Uint8Array(32));
      writeKeyFile(file, seed, o.force === true);
      const id = await identityFromSeed(seed);
      const suggested = os.hostname().replace(/[^A-Za-z0-9._-]/g, "-").replace(/^[^A-Za-z0-9]+/, "") || "my-node";
      print(`wrote ${file} (mode 0600)`);
      print(`public key   ${id.publicKey}`);
      print(`fingerprint  ${id.fingerprint}`);
      print();
      print(`Your peers add this entry to their peers.json (the petname is theirs to choose):`);
      print(JSON.stringify({ [suggested]: { key: id.publicKey } }, null, 2));
      return 0;
    },
  },
  id: {
    summary: "print this node's public key and fingerprint",
    options: { key: OPT.key },
    async run(o) {
      const id = await readIdentity(o.key as string);
      print(`public key   ${id.publicKey}`);
      print(`fingerprint  ${id.fingerprint}`);
      return 0;
    },
  },
  verify: {
    summary: "check signed messages read from stdin, one JSON object per line",
    about:
      "Prints one line per input line: `ok <sender key>` or `invalid: <reason>`. Accepts signed\n" +
      "messages, bus recv answers (the envelope's payload is checked) and announcements.\n" +
      "Exits 0 only if every line was ok.",
    options: {},
    async run() {
      const lines = (await readStdin()).split("\n");
      if (lines.at(-1) === "") lines.pop();
      let allOk = lines.length > 0;
      for (const line of lines) {
        const verdict = line.trim() === "" ? "invalid: empty line" : await verifyLine(line);
        if (!verdict.startsWith("ok ")) allOk = false;
        print(verdict);
      }
      return allOk ? 0 : 1;
    },
  },
};

function optionDefault(spec: OptionSpec): string | undefined {
  return typeof spec.default === "function" ? spec.default() : spec.default;
}

export function commandHelp(name: string): string {
  const cmd = COMMANDS[name];
  const rows = Object.entries(cmd.options).map(([flag, spec]) => {
    const left = `${spec.short ? `-${spec.short}, ` : ""}--${flag}${spec.type === "string" ? ` ${spec.arg ?? "VALUE"}` : ""}`;
    const notes = [spec.env && `env ${spec.env}`, spec.default !== undefined && `default ${tildify(optionDefault(spec)!)}`].filter(Boolean);
    return [left, spec.help + (notes.length ? `  [${notes.join("; ")}]` : "")];
  });
  rows.push(["-h, --help", "show this help"]);
  const width = Math.max(...rows.map(([l]) => l.length));
  return [
    `Usage: interlink.ts ${name}${Object.keys(cmd.options).length ? " [options]" : ""}${cmd.args ? " " + cmd.args : ""}`,
    "",
    cmd.summary.charAt(0).toUpperCase() + cmd.summary.slice(1) + ".",
    ...(cmd.about ? ["", cmd.about] : []),
    "",
    "Options:",
    ...rows.map(([l, r]) => `  ${l.padEnd(width)}  ${r}`),
  ].join("\n");
}

export function programHelp(): string {
  const width = Math.max(...Object.keys(COMMANDS).map((n) => n.length));
  return [
    `interlink ${VERSION}: authenticated agent-to-agent chat and task delegation for Claude Code`,
    "",
    "Usage: interlink.ts <command> [options]",
    "",
    "Commands:",
    ...Object.entries(COMMANDS).map(([n, c]) => `  ${n.padEnd(width)}  ${c.summary}`),
    "",
    "Run `interlink.ts <command> --help` for a command's options. Every option falls back",
    "to the INTERLINK_* variable its help names, then to the default shown there.",
  ].join("\n");
}

/** Parses argv for one command: flags, then env twins, then defaults. Unknown flags are an error. */
export function parseCommandLine(name: string, argv: string[]): { opts: Options; positionals: string[]; help: boolean } {
  const cmd = COMMANDS[name];
  const spec: Record<string, { type: "string" | "boolean"; short?: string }> = { help: { type: "boolean", short: "h" } };
  for (const [flag, o] of Object.entries(cmd.options)) spec[flag] = { type: o.type, ...(o.short ? { short: o.short } : {}) };
  let parsed;
  try {
    parsed = parseArgs({ args: argv, options: spec, allowPositionals: true, strict: true });
  } catch (e) {
    throw new InterlinkError(`${(e as Error).message.replace(/\. To specify.*$/s, "")}\n\n${commandHelp(name)}`);
  }
  const opts: Options = {};
  for (const [flag, o] of Object.entries(cmd.options)) {
    const given = (parsed.values as Options)[flag];
    const fromEnv = o.env ? process.env[o.env] : undefined;
    if (given !== undefined) opts[flag] = given;
    else if (fromEnv !== undefined && fromEnv !== "") opts[flag] = o.type === "boolean" ? envFlag(o.env!, fromEnv) : fromEnv;
    else opts[flag] = optionDefault(o);
  }
  return { opts, positionals: parsed.positionals, help: (parsed.values as Options).help === true };
}

function envFlag(name: string, value: string): boolean {
  if (/^(1|true|yes|on)$/i.test(value)) return true;
  if (/^(0|false|no|off)$/i.test(value)) return false;
  throw new InterlinkError(`${name}=${value} is not a boolean (use 1/0, true/false, yes/no or on/off)`);
}

// ============================================================================
// main
// ============================================================================

export async function main(argv: string[]): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "help" || name === "--help" || name === "-h") {
    print(programHelp());
    return name === undefined ? 2 : 0;
  }
  if (name === "--version" || name === "-V" || name === "version") {
    print(`interlink ${VERSION} (${runtimeName()})`);
    return 0;
  }
  const cmd = COMMANDS[name];
  if (!cmd) {
    process.stderr.write(`interlink: unknown command '${name}'\n\n${programHelp()}\n`);
    return 2;
  }
  try {
    const { opts, positionals, help } = parseCommandLine(name, rest);
    if (help) {
      print(commandHelp(name));
      return 0;
    }
    return await cmd.run(opts, positionals);
  } catch (e) {
    if (e instanceof InterlinkError) {
      process.stderr.write(`interlink ${name}: ${e.message}\n`);
      return 1;
    }
    throw e;
  }
}

if (import.meta.main) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (e) => {
      process.stderr.write(`interlink: ${(e as Error).stack ?? e}\n`);
      process.exit(70);
    },
  );
}
