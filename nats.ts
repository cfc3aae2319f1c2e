/**
 * nats.ts: NATS JetStream as interlink's relay, for teams that already run NATS (docs/nats.md). interlink.ts loads it
 * at the first use of a nats:// or tls:// URL, and only then; this file fetches the official NATS client packages on
 * its first connect. It imports interlink.ts for the wire (the Relay interface, RelayError, encoding, the bounds a
 * bus shares); the node never imports it statically, and a copy of interlink.ts alone given a NATS URL says to fetch
 * this file (what is sent meanwhile waits in its outbox).
 *
 * What it maps (docs/nats.md, "Mapping"): one work-queue stream, INTERLINK (a message is deleted once acked), with a
 * subject per route, interlink.in.<key>[.<base64url(session)>] (session ids may hold dots), a new message refused past
 * QUEUE_CAP per subject (a stream of an earlier release drops the oldest instead: see NatsLink.refuses). Each route is
 * read through a durable pull consumer, one unacked message at a time, so a route stays in order. Publishes carry
 * Nats-Msg-Id "<from>.<msg_id>.<route>", so a copy within the stream's 2-minute window is dropped (the replay memory
 * drops any other). The roster is the key-value bucket "interlink-roster", keyed "<key>.<base64url(session)>"; an
 * entry's age is the time since it was written.
 *
 * What it defends: nothing a publish was acknowledged for is dropped for room (a full subject refuses the next, and
 * the sender keeps it); a route's consumer is named by the route key's signature (natsConsumer), so with listing
 * denied only that key's holder can find it and read its mail (docs/nats.md, "Who may read a route"); a node's
 * replies come under its own inbox prefix; the roster read keeps each key's newest entries, so one node's junk cannot
 * push another's sessions off, and the node verifies every entry, as with a bus; every step has a deadline, so a
 * reconnecting client never holds a session up; a message held by a reader that is gone (killed before its ack) is
 * handed back by the route's next reader as it opens the route, so it never holds the route for the ack wait.
 * What it does not defend: who may publish, read or ack is the NATS account's permissions (natsPermissions lists
 * what a node needs), not interlink's; confidentiality (the server reads every payload); availability against the
 * server's operator, who can drop or delay but never forge.
 *
 * Sections, in dependency order (each uses only what stands above it):
 *   The mapping · Connecting · The relay
 */

import { Buffer } from "node:buffer";
import * as fs from "node:fs";
import * as path from "node:path";
import {
  type Announcement,
  ANNOUNCEMENT_MAX_BYTES,
  ANNOUNCEMENT_VALUES_MAX,
  b64urlEncode,
  BODY_LIMIT_BYTES,
  type Bytes,
  errorText,
  GOODBYE_MS,
  HELD_MAX_MS,
  InterlinkError,
  isObject,
  jsonShape,
  msFromEnv,
  parseRoute,
  QUEUE_CAP,
  type Received,
  redactUrl,
  type Relay,
  RelayError,
  ROSTER_CAP,
  ROSTER_PER_KEY_CAP,
  ROSTER_RETENTION_MS,
  ROUTE_FULL,
  runtimeHost,
  SEND_TIMEOUT_MS,
  SESSION_RE,
  thisScript,
  utf8,
  VERSION,
} from "./interlink.ts";

// ============================================================================
// The mapping
// ============================================================================
//
// Names and bounds on the server (see above), each computed from a route or a key alone.

const NATS_STREAM = "INTERLINK";

const NATS_ROSTER = "interlink-roster";

/** Unacked this long, a message is handed over again (the agent acks within milliseconds of journaling it). */
const NATS_ACK_WAIT_MS = msFromEnv("INTERLINK_TEST_NATS_ACK_WAIT_MS", 10_000);

/** A new stream's bound per subject (route), as our bus's QUEUE_CAP; a test lowers it (a new stream only). */
const NATS_SUBJECT_CAP = msFromEnv("INTERLINK_TEST_NATS_SUBJECT_CAP", QUEUE_CAP);

/** How long one pull waits: short, since a pull lost when a cluster's consumer leader moves is never answered. */
const NATS_PULL_MS = 5_000;

/** A route's subject (see above): only a real key and a session id make one, so no route can reach another's. */
function natsSubject(route: string): string {
  const { key, session } = parseRoute(route);
  if (!/^[A-Za-z0-9_-]{43}$/.test(key) || (session && !SESSION_RE.test(session))) {
    throw new RelayError(`'${route.slice(0, 80)}' is not a route (key#session)`, true);
  }
  return `interlink.in.${key}${session ? `.${b64urlEncode(utf8.encode(session))}` : ""}`;
}

const natsRosterKey = (key: string, session: string): string => `${key}.${b64urlEncode(utf8.encode(session))}`;

/** A route's durable consumer name (see above); without `sign` (not the route's key), of the route alone. */
async function natsConsumer(route: string, sign?: (data: Bytes) => Promise<string>): Promise<string> {
  const secret = sign ? await sign(utf8.encode(`interlink-nats-consumer-v1\0${route}`)) : route;
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", utf8.encode(secret)));
  return `in_${Buffer.from(digest).toString("hex").slice(0, 40)}`;
}

/**
 * The ack subject of a route's delivery, as JetStream gives it with each message ($JS.ACK.<stream>.<consumer>.
 * <delivered>.<stream seq>.<consumer seq>.<time>.<pending>: ADR-15). The server finds what is acked by the two sequences,
 * so a route's next reader can nak what a reader that is gone still holds (see NatsRelay.#openConsumer).
 */
const natsAckSubject = (consumer: string, streamSeq: number, consumerSeq: number): string =>
  `$JS.ACK.${NATS_STREAM}.${consumer}.1.${streamSeq}.${consumerSeq}.0.0`;

/** A node's reply-inbox prefix: only its own user may subscribe under it (see natsPermissions). */
const natsInbox = (key: string): string => `_INBOX_${key}`;

/**
 * What one node's NATS user needs, and no more (docs/nats.md, "Who may read a route"): send to any route; create
 * consumers only on its own subjects; pull and ack through consumers whose names it knows; write only its own roster
 * entries. Not: making, deleting or purging the stream (an admin creates it), listing or deleting consumers, reading
 * by sequence.
 */
function natsPermissions(key: string): { publish: { allow: string[] }; subscribe: { allow: string[] } } {
  const kv = `KV_${NATS_ROSTER}`;
  return {
    publish: {
      allow: [
        "interlink.in.*",
        "interlink.in.*.*",
        "$JS.API.INFO",
        `$JS.API.STREAM.INFO.${NATS_STREAM}`,
        `$JS.API.CONSUMER.CREATE.${NATS_STREAM}.*.interlink.in.${key}`,
        `$JS.API.CONSUMER.CREATE.${NATS_STREAM}.*.interlink.in.${key}.*`,
        `$JS.API.CONSUMER.INFO.${NATS_STREAM}.*`,
        `$JS.API.CONSUMER.MSG.NEXT.${NATS_STREAM}.*`,
        `$JS.ACK.${NATS_STREAM}.>`,
        `$KV.${NATS_ROSTER}.${key}.*`,
        `$JS.API.STREAM.INFO.${kv}`,
        `$JS.API.STREAM.MSG.GET.${kv}`,
        `$JS.API.DIRECT.GET.${kv}.>`,
        `$JS.API.CONSUMER.CREATE.${kv}.>`,
        `$JS.API.CONSUMER.INFO.${kv}.>`,
        `$JS.API.CONSUMER.DELETE.${kv}.>`,
      ],
    },
    subscribe: { allow: [`${natsInbox(key)}.>`] },
  };
}

// ============================================================================
// Connecting
// ============================================================================
//
// The client packages load at the first connect; a connection creates the stream and the roster bucket when they are
// missing, and says what the account lacks if it may not.

/** The official NATS client packages: loaded only when a nats:// or tls:// relay is configured. */
const NATS_PKGS = {
  transport: { name: "@nats-io/transport-node", version: "3.4.0" },
  jetstream: { name: "@nats-io/jetstream", version: "3.4.0" },
  kv: { name: "@nats-io/kv", version: "3.4.0" },
} as const;

/**
 * Imports a pinned package: under Deno as an npm: specifier, so a lone interlink.ts needs no deno.json; under Bun by
 * name@version, which Bun's auto-install fetches when no node_modules is in the way. When one is (Bun then does not
 * auto-install), the error says exactly what to run.
 */
async function importPinned<T>(pkg: { name: string; version: string }, subpath = ""): Promise<T> {
  const spec = `${runtimeHost.Deno ? "npm:" : ""}${pkg.name}@${pkg.version}${subpath}`;
  try {
    return await import(spec) as T;
  } catch (e) {
    // Bun with a node_modules in the way resolves name@version for some packages but not others (a bare
    // package name, such as the NATS ones): then the copy installed there, if its version is the pinned one.
    if (runtimeHost.Bun) {
      const installed = await import(`${pkg.name}/package.json`).then((m) => m.default?.version, () => undefined);
      if (installed === pkg.version) return await import(`${pkg.name}${subpath}`) as T;
    }
    const dir = path.dirname(thisScript());
    throw new InterlinkError(
      runtimeHost.Bun
        ? `cannot load ${pkg.name}@${pkg.version} (${
          (e as Error).message
        }). A node_modules folder in ${dir} or above it turns off Bun's auto-install: run interlink with \`bun --install=force ${thisScript()} …\`, or \`bun add ${pkg.name}@${pkg.version}\` in ${dir}.`
        : `cannot load ${spec} (${
          (e as Error).message
        }); Deno fetches it from the npm registry on first use: check the network, or NODE_EXTRA_CA_CERTS behind a TLS-inspecting proxy.`,
    );
  }
}

/** The few parts of the NATS client packages interlink uses (they load at run time, only for a NATS relay). */
interface NatsMsg {
  data: Uint8Array;
  ackAck(): Promise<boolean>;
  nak(): void;
}

/** What the server says of a route's consumer (the part read): what it handed over last, and whether it waits unacked. */
interface NatsConsumerInfo {
  num_ack_pending: number;
  delivered: { stream_seq: number; consumer_seq: number };
}

interface NatsConsumer {
  next(o: { expires: number }): Promise<NatsMsg | null>;
  info(cached: boolean): Promise<NatsConsumerInfo>;
}

interface NatsLink {
  nc: {
    publish(subject: string, data: string): void;
    rtt(): Promise<number>;
    close(): Promise<void>;
    closed(): Promise<void | Error>;
    status(): AsyncIterable<{ type: string }>;
  };
  js: {
    publish(subject: string, data: string, opts: { msgID?: string; timeout?: number }): Promise<unknown>;
    consumers: {
      get(stream: string, name: string): Promise<NatsConsumer>;
    };
  };
  jsm: {
    streams: { info(name: string): Promise<unknown>; add(cfg: object): Promise<unknown> };
    consumers: { add(stream: string, cfg: object): Promise<unknown> };
  };
  kv: {
    put(key: string, value: string): Promise<unknown>;
    get(key: string): Promise<{ operation: string; created: Date; string(): string } | null>;
    delete(key: string): Promise<void>;
    keys(): Promise<AsyncIterable<string>>;
  };
  /** The stream refuses a publish to a full subject (discard new, per subject); false: it drops the oldest there. */
  refuses: boolean;
}

/** A RelayError if `step` takes longer than `ms`; the step itself goes on. */
async function withTimeout<T>(ms: number, what: string, step: () => Promise<T>): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new RelayError(`${what} timed out after ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([step(), late]);
  } finally {
    clearTimeout(timer);
  }
}

/** Runs a setup step; a permission error says what the account must allow. */
async function natsNeeds<T>(what: string, step: () => Promise<T>): Promise<T> {
  try {
    return await step();
  } catch (e) {
    if (/permission/i.test(errorText(e))) {
      throw new InterlinkError(
        `the NATS account may not use ${what} (${
          errorText(e)
        }): see docs/nats.md, "Who may read a route", for the permissions interlink needs, or have an admin create it`,
      );
    }
    throw e;
  }
}

/**
 * Connects to a NATS relay, creating the stream and the roster bucket on first use. Credentials: user and password,
 * or a token, in the URL; INTERLINK_NATS_CREDS (a .creds file) or INTERLINK_NATS_NKEY (an nkey seed file);
 * INTERLINK_NATS_CA (a CA file); tls:// asks for TLS. INTERLINK_NATS_REPLICAS (1) sets the replicas it creates.
 */
async function connectNats(url: string, key?: string): Promise<NatsLink> {
  // deno-lint-ignore no-explicit-any -- the packages' types would need their npm install: NatsLink names what is used
  type Loose = Record<string, any>;
  const { transport: t, jetstream: j, kv: k } = NATS_PKGS;
  const [transport, jetstreamPkg, kvPkg] = await Promise.all([t, j, k].map((p) => importPinned<Loose>(p)));
  const u = new URL(url.replace(/^tls:/i, "nats:"));
  const env = process.env;
  const auth = u.password
    ? { user: decodeURIComponent(u.username), pass: decodeURIComponent(u.password) }
    : u.username
    ? { token: decodeURIComponent(u.username) }
    : {};
  const authenticator = env.INTERLINK_NATS_CREDS
    ? transport.credsAuthenticator(fs.readFileSync(env.INTERLINK_NATS_CREDS))
    : env.INTERLINK_NATS_NKEY
    ? transport.nkeyAuthenticator(utf8.encode(fs.readFileSync(env.INTERLINK_NATS_NKEY, "utf8").trim()))
    : undefined;
  const tls = /^tls:/i.test(url) || env.INTERLINK_NATS_CA
    ? (env.INTERLINK_NATS_CA ? { caFile: env.INTERLINK_NATS_CA } : {})
    : undefined;
  const nc = await transport.connect({
    servers: `${u.hostname}:${u.port || 4222}`,
    name: `interlink ${VERSION}`,
    // Replies (pulled messages among them) come under the node's own inbox prefix, which only it may subscribe to.
    ...(key ? { inboxPrefix: natsInbox(key) } : {}),
    maxReconnectAttempts: -1,
    reconnectTimeWait: 500,
    ...auth,
    ...(authenticator ? { authenticator } : {}),
    ...(tls ? { tls } : {}),
  });
  try {
    const replicas = Number(env.INTERLINK_NATS_REPLICAS ?? 1);
    const jsm = await natsNeeds<NatsLink["jsm"]>("JetStream", () => jetstreamPkg.jetstreamManager(nc)).catch(
      (e: Error) => {
        if (e instanceof InterlinkError) throw e; // the account's permissions: said as such
        throw new InterlinkError(
          `JetStream is not enabled on ${redactUrl(url)} (${errorText(e)}): start nats-server with -js`,
        );
      },
    );
    const refuses = await natsNeeds("the stream " + NATS_STREAM, async () => {
      let info: { config: Record<string, unknown> };
      try {
        info = await jsm.streams.info(NATS_STREAM) as typeof info;
      } catch (e) {
        if (!/not found/i.test(errorText(e))) throw e;
        // A full subject refuses the next publish (the sender retries), never drops an acknowledged one.
        info = await jsm.streams.add({
          name: NATS_STREAM,
          subjects: ["interlink.in.>"],
          retention: "workqueue",
          storage: "file",
          num_replicas: replicas,
          max_msgs_per_subject: NATS_SUBJECT_CAP,
          discard: "new",
          discard_new_per_subject: true,
          max_msg_size: BODY_LIMIT_BYTES,
          max_age: HELD_MAX_MS * 1e6, // older is refused as stale by any node of ours (and its sender told)
        }) as typeof info;
      }
      // Other rules could lose mail silently: say so. An earlier release's stream (discard old) is used as it is (its
      // nodes refuse any other policy), our senders holding routes by receipts there (SEND_WINDOW).
      const c = info.config;
      const wrong = [
        c.retention !== "workqueue" && `retention ${c.retention} (needs workqueue)`,
        !(c.subjects as string[] | undefined)?.includes("interlink.in.>") && `subjects ${JSON.stringify(c.subjects)}`,
        c.discard !== "old" && c.discard !== "new" && `discard ${c.discard} (needs new, or old)`,
      ].filter(Boolean);
      if (wrong.length) {
        throw new InterlinkError(
          `the stream ${NATS_STREAM} on ${redactUrl(url)} has other settings than interlink needs: ${
            wrong.join(", ")
          }; see docs/nats.md, "Mapping"`,
        );
      }
      return c.discard === "new" && c.discard_new_per_subject === true;
    });
    const kvm = new kvPkg.Kvm(nc);
    const kv = await natsNeeds<NatsLink["kv"]>(
      "the key-value bucket " + NATS_ROSTER,
      () =>
        kvm.open(NATS_ROSTER).then(async (b: { status(): Promise<unknown> }) => (await b.status(), b)).catch(
          () =>
            kvm.create(NATS_ROSTER, {
              history: 1,
              ttl: ROSTER_RETENTION_MS,
              replicas,
              max_value_size: ANNOUNCEMENT_MAX_BYTES,
            }),
        ),
    );
    return { nc, js: jetstreamPkg.jetstream(nc), jsm, kv, refuses };
  } catch (e) {
    await nc.close().catch(() => {});
    throw e;
  }
}

// ============================================================================
// The relay
// ============================================================================

/** NATS JetStream as a relay (see above). Connects on first use and reconnects by itself. */
class NatsRelay implements Relay {
  #link: Promise<NatsLink> | null = null;
  /** The stream refuses a publish to a full subject (learned at connect: see NatsLink.refuses). */
  #refuses = false;
  #consumers = new Map<string, Promise<NatsConsumer>>();

  /** `sign` names our consumers; `key`, the node's, its reply inboxes (both absent for doctor). */
  constructor(readonly url: string, readonly sign?: (data: Bytes) => Promise<string>, readonly key?: string) {}

  get name(): string {
    return redactUrl(this.url);
  }

  link(): Promise<NatsLink> {
    if (this.#link) return this.#link;
    const current: Promise<NatsLink> = connectNats(this.url, this.key).then((link) => {
      this.#refuses = link.refuses;
      void this.#watch(link);
      // A connection closed for good (not a reconnect): the next call connects anew, and reopens the consumers.
      void link.nc.closed().then(() => {
        if (this.#link === current) this.#link = null;
        this.#consumers.clear();
      });
      return link;
    }, (e) => {
      if (this.#link === current) this.#link = null; // the next call tries again
      throw e;
    });
    this.#link = current;
    return current;
  }

  #back: (() => void)[] = [];

  onBack(back: () => void): void {
    this.#back.push(back);
  }

  refusesWhenFull(): boolean {
    return this.#refuses;
  }

  /** Calls the onBack hooks after each reconnect (to another server of a cluster, say). */
  async #watch(link: NatsLink): Promise<void> {
    for await (const s of link.nc.status()) if (s.type === "reconnect") { for (const back of this.#back) back(); }
  }

  async send(route: string, payload: object, timeoutMs: number): Promise<void> {
    const { js } = await withTimeout(timeoutMs, `${this.name}: connect`, () => this.link());
    const p = payload as Record<string, unknown>;
    const msgID = typeof p.msg_id === "string" ? `${p.from}.${p.msg_id}.${route}` : undefined;
    try {
      await js.publish(natsSubject(route), JSON.stringify(payload), {
        ...(msgID ? { msgID } : {}),
        timeout: timeoutMs,
      });
    } catch (e) {
      if (e instanceof RelayError) throw e;
      const why = errorText(e), full = /maximum messages per subject/i.test(why); // a stream that refuses, not drops
      const tooBig = /maximum (payload|message size)|max_payload/i.test(why);
      throw new RelayError(`${this.name}: ${full ? `${ROUTE_FULL}: ` : ""}${why}`, tooBig, full);
    }
  }

  async recv(route: string, signal: AbortSignal, waitMs = NATS_PULL_MS): Promise<Received> {
    // A pull waits at least a second (the client's floor for a pull's expiry).
    const m = await this.#pull(route, signal, Math.max(1000, Math.min(waitMs, NATS_PULL_MS)));
    if (!m) return { items: [] };
    let payload: unknown;
    try {
      payload = JSON.parse(new TextDecoder().decode(m.data));
    } catch {
      payload = undefined; // not JSON: the gate calls it malformed, and it is acked
    }
    return { items: [{ payload, ack: async () => void (await m.ackAck()) }] };
  }

  /** One message of the route's consumer, or null when none came within NATS_PULL_MS or on stop. */
  async #pull(route: string, signal: AbortSignal, expires: number): Promise<NatsMsg | null> {
    let consumer = this.#consumers.get(route);
    if (!consumer) {
      consumer = this.#openConsumer(route);
      this.#consumers.set(route, consumer);
      consumer.catch(() => this.#consumers.delete(route));
    }
    // A pull cannot be cancelled: on stop, stop waiting. What it may still fetch is handed back at once (nak): left
    // unacked it would block the route (one unacked at a time) for NATS_ACK_WAIT_MS.
    const stopped = new Promise<null>((resolve) =>
      signal.addEventListener("abort", () => resolve(null), { once: true })
    );
    let m: NatsMsg | null;
    try {
      const c = await Promise.race([
        withTimeout(SEND_TIMEOUT_MS * 2, `${this.name}: consumer`, () => consumer),
        stopped,
      ]);
      if (!c || signal.aborted) return null;
      const next = c.next({ expires });
      const handBack = () => void next.then((late) => late?.nak(), () => {});
      try {
        m = await Promise.race([withTimeout(expires + SEND_TIMEOUT_MS, `${this.name}: pull`, () => next), stopped]);
      } catch (e) {
        handBack(); // timed out: it may still come
        throw e;
      }
      if (m === null && signal.aborted) handBack();
    } catch (e) {
      // The consumer may be gone (unused past inactive_threshold, deleted, the stream made anew): reopen it next time.
      if (this.#consumers.get(route) === consumer) this.#consumers.delete(route);
      throw e;
    }
    return m;
  }

  /**
   * Opens (creating if need be) the route's consumer, and hands back (a nak) what it still has out: a process opens a
   * route as it starts reading it (its own, the key's once it holds bare.lock, an ended session's it adopted), so a
   * message out then is held by a reader that is gone, a session killed before its ack, say. Left to the ack wait, it
   * would hold the route (one unacked at a time) for NATS_ACK_WAIT_MS. Were its reader only slow, both admit it under
   * the one replay check, and the second copy is refused as a replay.
   */
  async #openConsumer(route: string): Promise<NatsConsumer> {
    const { js, jsm, nc } = await this.link();
    const name = await natsConsumer(route, this.sign);
    await natsNeeds(`a consumer on ${NATS_STREAM}`, async () => {
      try {
        await jsm.consumers.add(NATS_STREAM, {
          durable_name: name,
          filter_subject: natsSubject(route),
          ack_policy: "explicit",
          ack_wait: NATS_ACK_WAIT_MS * 1e6,
          max_ack_pending: 1, // in order, as on a bus: an unacked message stays at the head until acked or redelivered
          inactive_threshold: ROSTER_RETENTION_MS * 1e6,
        });
      } catch (e) {
        if (!/already (exists|in use)/i.test(errorText(e))) throw e;
      }
    });
    const consumer = await js.consumers.get(NATS_STREAM, name);
    const { num_ack_pending, delivered } = await consumer.info(true); // as the server answered get
    // One out at most (max_ack_pending): the last one handed over.
    if (num_ack_pending === 1) nc.publish(natsAckSubject(name, delivered.stream_seq, delivered.consumer_seq), "-NAK");
    return consumer;
  }

  announce(a: Announcement): Promise<void> {
    return withTimeout(SEND_TIMEOUT_MS, `${this.name}: announce`, async () => {
      const { kv } = await this.link();
      await kv.put(natsRosterKey(a.pubkey, a.session?.session_id ?? ""), JSON.stringify(a));
    });
  }

  /** Every entry of the roster bucket; within `timeoutMs` (a reconnecting client would otherwise wait). */
  roster(timeoutMs = SEND_TIMEOUT_MS): Promise<unknown[]> {
    return withTimeout(timeoutMs, `${this.name}: roster`, () => this.#roster());
  }

  /**
   * Keys come oldest write first (live sessions rewrite theirs every ANNOUNCE_EVERY_MS): the newest ROSTER_PER_KEY_CAP
   * per node key (a node writes only under its own), then the newest ROSTER_CAP, so junk or stale entries cannot push
   * live ones out. An entry filed under another key or session than it announces is dropped.
   */
  async #roster(): Promise<unknown[]> {
    const { kv } = await this.link();
    const byOwner = new Map<string, { k: string; at: number }[]>();
    let at = 0;
    for await (const k of await kv.keys()) {
      const owner = k.split(".")[0];
      const list = byOwner.get(owner) ?? [];
      list.push({ k, at: at++ });
      if (list.length > ROSTER_PER_KEY_CAP) list.shift();
      byOwner.set(owner, list);
    }
    const keys = [...byOwner.values()].flat().sort((a, b) => a.at - b.at).slice(-ROSTER_CAP).map((x) => x.k);
    const now = Date.now();
    const entries = await Promise.all(keys.map(async (k) => [k, await kv.get(k)] as const));
    return entries.flatMap(([k, e]) => {
      if (!e || e.operation !== "PUT") return [];
      try {
        const text = e.string();
        if (jsonShape(text).values > ANNOUNCEMENT_VALUES_MAX) return []; // what our bus refuses: see JSON_VALUES_MAX
        const a = JSON.parse(text);
        if (!isObject(a) || typeof a.pubkey !== "string") return [];
        const session = isObject(a.session) && typeof a.session.session_id === "string" ? a.session.session_id : "";
        if (natsRosterKey(a.pubkey, session) !== k) return [];
        return [{ ...a, age_ms: Math.max(0, now - e.created.getTime()) }];
      } catch {
        return [];
      }
    });
  }

  unregister(u: { pubkey: string; session: { session_id: string } }, timeoutMs: number): Promise<void> {
    return withTimeout(timeoutMs, `${this.name}: unregister`, async () => {
      const { kv } = await this.link();
      await kv.delete(natsRosterKey(u.pubkey, u.session.session_id));
    });
  }

  async close(): Promise<void> {
    const link = this.#link;
    this.#link = null;
    // A connect still in progress, or a server gone: never hold a shutdown up for long.
    await withTimeout(GOODBYE_MS, `${this.name}: close`, async () => await (await link?.catch(() => null))?.nc.close())
      .catch(() => {});
  }
}

// -- the public surface ---------------------------------------------------------
//
// What interlink.ts (NatsRelay, loaded at its first NATS URL), doctor, the tests, the harness and the bench import.

export {
  connectNats,
  importPinned,
  NATS_ROSTER,
  NATS_STREAM,
  natsConsumer,
  natsInbox,
  natsPermissions,
  NatsRelay,
  natsSubject,
  withTimeout,
};
