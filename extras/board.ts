/**
 * extras/board.ts: `interlink.ts board`: one page for the operator, on loopback, showing what
 * the journals of every session of this node on this machine and the roster
 * say: which sessions are live, every task with its timeline, the questions
 * and knocks waiting on the operator, and how delivery goes. It only reads:
 * it takes no lock, announces nothing, sends nothing, writes nothing; trust
 * stays with the operator's own tools (accept_pair, `peers add`).
 *
 * Three parts, as with the bus: BoardFold folds the journals incrementally (a
 * byte offset per file: journals are append-only, and one rolled over is read
 * on as its archive), boardView turns the fold into a bounded, plain-JSON view
 * model, and Board is the shell, a `Request → Response` handler serving the
 * page (/) and server-sent events carrying a fresh view (/events) whenever a
 * journal changes (fs.watch, and a re-check for what watching misses) and
 * every BOARD_TICK_MS (presence ages move).
 *
 * Who may read it: the board binds 127.0.0.1 and answers only requests that
 * carry its token (32 random bytes, in the URL it prints), whose Host is
 * 127.0.0.1 or localhost on its port (a DNS-rebinding page names its own
 * host), and whose Origin, if sent, is the board's. The token rides in the
 * query, never in a cookie: cookies do not tell ports apart, so a browser
 * would hand one to any other local server. Peer-controlled text (messages,
 * ids, claimed names, summaries) reaches the page as JSON strings with
 * invisible and bidi characters made visible, and the page only ever sets it
 * as text (textContent), never as markup; the CSP lets no other script run.
 */

import * as fs from "node:fs";
import * as path from "node:path";
import {
  b64urlEncode,
  BoundedMap,
  type CommandSpec,
  counterpart,
  EMPTY_PEERS,
  errorText,
  EXTRAS,
  fileSize,
  fingerprint,
  FRESH_PAST_MS,
  inodeOf,
  InterlinkError,
  intOption,
  journalFiles,
  type JournalRecord,
  loadPeers,
  lockOwner,
  logInfo,
  newPeerName,
  NODE_OPTIONS,
  nodeClock,
  nodeConfig,
  NodeState,
  openRelay,
  type Options,
  type OptionSources,
  type OutEntry,
  ownerWord,
  parseRoute,
  type Peers,
  type PeerSession,
  presence,
  print,
  readRoster,
  type ReceiptState,
  recordedReports,
  redactUrl,
  refusalWords,
  type Relay,
  runExtra,
  scanJournal,
  SERVER_ROLE,
  sessionDir,
  sessionEndedAt,
  sessionIds,
  type SessionInfo,
  setLogComponent,
  showId,
  showInvisible,
  shutdownSignal,
  some,
  taskKey,
  taskOwner,
  type TaskRow,
  type TaskStatus,
  utf8,
} from "../interlink.ts";
import { type Listening, serveHttp } from "../bus.ts";

/** Tasks in a view, newest activity first: many screenfuls, and a snapshot stays well under a megabyte. */
export const BOARD_TASKS_MAX = 200;
/** Messages shown per task: the request, then the newest. */
export const BOARD_TIMELINE_MAX = 8;
/** Tasks whose timelines the fold keeps, least recently active dropped first: far above BOARD_TASKS_MAX. */
export const BOARD_TIMELINES_CAP = 1000;
/** Characters of one message shown; `interlink.ts log` has the rest. */
export const BOARD_TEXT_MAX = 280;
/** Rows in each list besides the tasks: waiting on you, outbox, refusals, receipts. */
export const BOARD_LIST_MAX = 50;
/** Sessions listed, ours and peers', live first. */
export const BOARD_SESSIONS_MAX = 100;
/** Session folders folded, the most recently active: a state root gathers one per session ever run. */
const BOARD_FOLDERS_MAX = 256;
/** Event streams open at once (a few tabs); past it a new one is refused, so no client can grow the server. */
const BOARD_CLIENTS_MAX = 16;
/** A change is folded and sent after this much quiet: a burst of appends becomes one snapshot. */
const BOARD_DEBOUNCE_MS = 100;
/** Journals are re-checked this often besides fs.watch, which can miss a change. */
const BOARD_RECHECK_MS = 2_000;
/** The roster is re-read and a snapshot sent this often: ages move, and the stream never idles out. */
const BOARD_TICK_MS = 15_000;

export type BoardPresence = "live" | "away" | "gone" | "unknown";

/** One message of a task, as the board shows it; `delivery` is what we know of one we sent. */
export interface BoardItem {
  at: number;
  dir: "in" | "out";
  msg_id: string;
  status: TaskStatus | null;
  text: string;
  in_reply_to?: string;
  /** The session of ours whose journal holds it. */
  session: string;
  delivery?: string;
}

/** The view model: plain JSON, every list capped; `totals` counts what the caps left out. */
export interface BoardView {
  now: number;
  node: { fingerprint: string; state: string; relays: string[] };
  problems: string[];
  sessions: {
    side: "yours" | "peer";
    who: string;
    session: string;
    presence: BoardPresence;
    seen_at: number | null;
    host: string;
    where: string;
    summary: string;
    note: string;
  }[];
  tasks: {
    session: string;
    task_id: string;
    peer: string;
    peer_session: string | null;
    requested_by: string;
    status: TaskStatus | null;
    closed: boolean;
    blocked_on: { who: string; why: string } | null;
    /** A sub-task: the task it serves, at its requester's node, whose operator owns the work, and whose word that is. */
    parent: { task_id: string; requester: string; owner: string; word: string | null } | null;
    last_at: number;
    messages: number;
    note: string;
    timeline: BoardItem[];
    /** Messages left out between the first one shown and the rest. */
    elided: number;
  }[];
  waiting: (
    | {
      kind: "question";
      at: number;
      session: string;
      peer: string;
      task_id: string;
      msg_id: string;
      text: string;
      /** Whose operator owns the answer ("you", or the owner up the chain when its question could not go there). */
      owner: string;
      say: string;
      command: string;
    }
    | {
      kind: "knock";
      at: number;
      session: string;
      fingerprint: string;
      name: string;
      say: string;
      say_reject: string;
      command: string;
    }
  )[];
  delivery: {
    outbox: { at: number; session: string; to: string; task_id: string; msg_id: string; text: string; note: string }[];
    by_reason: { reason: string; count: number }[];
    refusals: BoardRefusal[];
    receipts: BoardReceipt[];
  };
  /** What `interlink.ts serve` runs or holds (its executors.json), and the denials its operator has to decide on. */
  executors: {
    peer: string;
    task: string;
    host: string;
    state: string;
    pid: number | null;
    cwd: string;
    started: number | null;
    turns: number | null;
    cost: number | null;
    denials: string[];
  }[];
  totals: { sessions: number; tasks: number; open: number; waiting: number; outbox: number };
}

/** A refusal: `in` our gate refused a sender's message, `out` a peer's gate refused ours, `bus` every relay did. */
export interface BoardRefusal {
  at: number;
  dir: "in" | "out" | "bus";
  who: string;
  reason: string;
  detail: string;
}

/** What a peer's receipts said of one message we sent, by our clock: delivered (journaled there), shown, refused. */
export interface BoardReceipt {
  at: number;
  peer: string;
  msg_id: string;
  task_id: string;
  text: string;
  state: ReceiptState;
  delivered?: number;
  shown?: number;
  detail: string;
}

/** Peer text for the page: at most `max` characters, invisible and bidi characters made visible. */
const boardText = (text: string, max = BOARD_TEXT_MAX): string =>
  showInvisible(text.length <= max ? text : Array.from(text.slice(0, 2 * max)).slice(0, max).join("") + "…");

/**
 * A word for a POSIX shell: as itself when plain, else single-quoted. A hidden character shows as its code point
 * (showInvisible): a command the operator copies runs what it reads as, never a word reordered by a bidi control.
 */
const shellWord = (word: string): string => {
  const s = showInvisible(word, true);
  return /^[A-Za-z0-9_@%+=:,./-]+$/.test(s) ? s : `'${s.replace(/'/g, `'\\''`)}'`;
};

/** Appends to a list kept at most `cap` long, oldest out first. */
function pushBounded<T>(list: T[], item: T, cap: number): void {
  list.push(item);
  if (list.length > cap) list.splice(0, list.length - cap);
}

interface FoldedSession {
  id: string;
  dir: string;
  state: NodeState;
  /** How far each journal file is folded, by inode: a journal rolled over is read on as the archive it became. */
  offsets: Map<number, number>;
  /** Its agent.lock is held by a running server. */
  live: boolean;
  /** Its last write (see sessionEndedAt). */
  activeAt: number;
  info: Partial<SessionInfo> & { host?: unknown; pubkey?: unknown };
  infoAt: number;
}

/** A task's messages: the first (the request) and the newest BOARD_TIMELINE_MAX - 1, and how many there were. */
interface Timeline {
  first: BoardItem;
  rest: BoardItem[];
  count: number;
}

/**
 * The journals of every session of a node on this machine, folded as they
 * grow: each session through its own NodeState (the agent's fold), plus what
 * the board shows and NodeState does not keep (task timelines, the last
 * refusals and receipts), all bounded. Reads only.
 */
export class BoardFold {
  readonly sessions = new Map<string, FoldedSession>();
  readonly timelines = new BoundedMap<string, Timeline>(BOARD_TIMELINES_CAP);
  readonly refusals: BoardRefusal[] = [];
  /** By msg_id, most recently reported last. */
  readonly receipts = new BoundedMap<string, BoardReceipt>(BOARD_LIST_MAX);
  /** Refusals counted by direction and reason (a closed set, and one bucket for the buses'). */
  readonly byReason = new Map<string, number>();
  /** Records folded so far: a catch-up reads only what was appended. */
  records = 0;

  constructor(readonly root: string, readonly selfKey: string, readonly now: () => number = Date.now) {}

  /** Folds what every session's journal gained since the last call, and its liveness; true if anything changed. */
  catchUp(): boolean {
    let changed = false;
    const folders = sessionIds(this.root).map((id) => {
      const dir = sessionDir(this.root, id);
      return { id, dir, activeAt: sessionEndedAt(dir) };
    }).sort((a, b) => a.activeAt - b.activeAt).slice(-BOARD_FOLDERS_MAX); // newest last: bounded lists keep them
    const present = new Set(folders.map((f) => f.id));
    for (const id of this.sessions.keys()) if (!present.has(id)) this.sessions.delete(id), changed = true;
    for (const f of folders) {
      const s = this.#session(f.id);
      const infoFile = path.join(f.dir, "session.json");
      let infoAt = 0;
      try {
        infoAt = fs.statSync(infoFile).mtimeMs;
      } catch {
        // no session.json (yet)
      }
      if (infoAt !== s.infoAt) {
        try {
          s.info = JSON.parse(fs.readFileSync(infoFile, "utf8"));
        } catch {
          s.info = {}; // none yet, or mid-rename
        }
        s.infoAt = infoAt;
        changed = true;
      }
      const live = lockOwner(path.join(f.dir, "agent.lock"))?.role === SERVER_ROLE;
      if (live !== s.live || f.activeAt !== s.activeAt) changed = true;
      Object.assign(s, { live, activeAt: f.activeAt });
      if (this.foreign(s)) continue;
      for (const file of journalFiles(f.dir)) {
        const ino = inodeOf(file);
        const from = s.offsets.get(ino) ?? 0;
        if (fileSize(file) < from) { // cut back: folded again from the start at the next look
          Object.assign(s, { state: new NodeState(this.now), offsets: new Map() });
          break;
        }
        const { next } = scanJournal(
          file,
          from,
          (r) => this.apply(f.id, r),
        );
        if (next !== from) changed = true;
        s.offsets.set(ino, next);
      }
    }
    return changed;
  }

  /** Another key's session in a state root shared by hand: left out, as adoption leaves it alone. */
  foreign(s: FoldedSession): boolean {
    return typeof s.info.pubkey === "string" && s.info.pubkey !== this.selfKey;
  }

  #session(id: string): FoldedSession {
    let s = this.sessions.get(id);
    if (!s) {
      const dir = sessionDir(this.root, id);
      s = {
        id,
        dir,
        state: new NodeState(this.now),
        offsets: new Map(),
        live: false,
        activeAt: 0,
        info: {},
        infoAt: -1,
      };
      this.sessions.set(id, s);
    }
    return s;
  }

  /** Folds one record of session `id`'s journal. */
  apply(id: string, r: JournalRecord): void {
    const s = this.#session(id);
    this.records++;
    try {
      s.state.apply(r);
    } catch {
      return; // a record the fold cannot take; the session's own agent sets it aside
    }
    const count = (reason: string) => this.byReason.set(reason, (this.byReason.get(reason) ?? 0) + 1);
    switch (r.t) {
      case "in":
      case "out": {
        const { msg } = r;
        if (msg.kind !== "message" || !msg.task_id || (r.t === "out" && s.state.outgoing.get(msg.msg_id)?.refused)) {
          return;
        }
        this.#addItem(taskKey(counterpart(r.t, msg), msg.task_id), {
          at: r.at,
          dir: r.t,
          msg_id: boardText(msg.msg_id),
          status: msg.status ?? null,
          text: boardText(msg.text),
          ...(msg.in_reply_to ? { in_reply_to: boardText(msg.in_reply_to) } : {}),
          session: id,
        });
        return;
      }
      case "refusal":
        count(`in ${r.reason}`);
        return pushBounded(
          this.refusals,
          { at: r.at, dir: "in", who: r.key, reason: r.reason, detail: boardText(r.detail) },
          BOARD_LIST_MAX,
        );
      case "refused": {
        count("bus every relay refused it");
        const to = s.state.outgoing.get(r.msg_id)?.msg.to ?? "";
        const detail = boardText(`${r.msg_id.slice(0, 12)}: ${r.reason}`);
        return pushBounded(
          this.refusals,
          { at: r.at, dir: "bus", who: to, reason: "every relay", detail },
          BOARD_LIST_MAX,
        );
      }
      case "receipt":
        for (const l of recordedReports(r)) {
          const was = this.receipts.get(l.msg_id);
          const sent = was ? undefined : s.state.outgoing.get(l.msg_id)?.msg;
          const detail = l.state === "refused" ? refusalWords(l) : `their session ${l.session}`;
          this.receipts.set(l.msg_id, {
            at: r.at,
            peer: r.msg.from,
            msg_id: l.msg_id,
            task_id: was?.task_id ?? boardText(sent?.task_id ?? ""),
            text: was?.text ?? boardText(sent?.text ?? "", 80),
            state: was?.state === "shown" && l.state === "delivered" ? "shown" : l.state,
            ...some("delivered", l.state === "delivered" ? r.at : was?.delivered),
            ...some("shown", l.state === "shown" ? r.at : was?.shown),
            detail,
          });
          if (l.state !== "refused") continue;
          count(`out ${l.reason}`);
          pushBounded(
            this.refusals,
            { at: r.at, dir: "out", who: r.msg.from, reason: l.reason ?? "refused", detail },
            BOARD_LIST_MAX,
          );
        }
        return;
    }
  }

  #addItem(key: string, item: BoardItem): void {
    const t = this.timelines.get(key);
    if (!t) return void this.timelines.set(key, { first: item, rest: [], count: 1 });
    if (t.first.msg_id === item.msg_id && t.first.dir === item.dir) return; // a folder folded again
    if (t.rest.some((x) => x.msg_id === item.msg_id && x.dir === item.dir)) return;
    t.count++;
    pushBounded(t.rest, item, BOARD_TIMELINE_MAX - 1);
    this.timelines.set(key, t); // most recently active last: the cap drops the quietest
  }

  /** The session that took over `id`'s work, following moves (a chain of adoptions). */
  finalSession(id: string): string {
    for (let i = 0; i < 16; i++) {
      const to = this.sessions.get(id)?.state.movedTo;
      if (!to || to === id) break;
      id = to;
    }
    return id;
  }
}

/** What boardView needs besides the fold: the clock, the allowlist, the roster (null: no relay answered). */
export interface BoardContext {
  now: number;
  peers: Peers;
  roster: PeerSession[] | null;
  problems: string[];
  relays: string[];
  /** Only this session of ours (`--session`). */
  only?: string;
  /** Settings the printed commands must carry to reach this node (those the board itself was given as flags). */
  cli?: Partial<Record<"key" | "peers" | "url" | "state", string>>;
  /** The rows of `serve`'s executors.json, as read (anything: a file is never trusted to be well formed). */
  executors?: unknown;
}

/** The view model of a fold: a pure function of it and `ctx`, every list capped. */
export function boardView(fold: BoardFold, ctx: BoardContext): BoardView {
  const { now, peers } = ctx;
  const name = (key: string) => (key === fold.selfKey ? "self" : peers.byKey.get(key) ?? fingerprint(key));
  const claim = (t: TaskRow) => {
    const by = ownerWord(t);
    return by === undefined ? null : name(by);
  };
  /** A task's owner by name, and whose word it is when it is a peer's claim. */
  const ownerSaid = (t: TaskRow, by = claim(t)) => name(taskOwner(t, fold.selfKey)) + (by ? ` (by ${by}'s word)` : "");
  const mine = [...fold.sessions.values()].filter((s) => !fold.foreign(s) && (!ctx.only || s.id === ctx.only));
  const cli = (words: string[], flags: ("key" | "peers" | "url" | "state")[]) =>
    ["interlink.ts", ...words, ...flags.flatMap((f) => (ctx.cli?.[f] ? [`--${f}`, ctx.cli[f]!] : []))].map(shellWord)
      .join(" ");
  const where = (info: Partial<SessionInfo>) => boardText(info.git_root || path.basename(info.cwd ?? ""), 80);

  const rosterAt = new Map((ctx.roster ?? []).map((p) => [`${p.key}#${p.session?.session_id ?? ""}`, p]));
  const sessions: BoardView["sessions"] = mine.map((s) => {
    const seen = rosterAt.get(`${fold.selfKey}#${s.id}`);
    return {
      side: "yours",
      who: "you",
      session: s.id,
      presence: s.live ? "live" : "gone",
      seen_at: s.live ? now - (seen?.ageMs ?? 0) : s.activeAt || null,
      host: s.info.host === "codex" ? "Codex" : s.info.host === "cli" ? "interlink.ts send" : "Claude Code",
      where: where(s.info),
      summary: boardText(String(s.info.summary ?? ""), 200),
      note: s.state.movedTo ? `ended; session ${s.state.movedTo} took over its work` : s.live ? "" : "not running",
    };
  });
  for (const [petname, key] of peers.byName) {
    const theirs = (ctx.roster ?? []).filter((p) => p.key === key);
    for (const p of theirs) {
      const state = presence(p.ageMs);
      sessions.push({
        side: "peer",
        who: petname,
        session: boardText(p.session?.session_id ?? "", 128), // as announced: any string
        presence: state === "stale" ? "gone" : state,
        seen_at: now - p.ageMs,
        host: "",
        where: p.session ? where(p.session) : "",
        summary: boardText(p.session?.summary ?? "", 200),
        note: p.legacy ? "a 0.4 node (no sessions)" : state === "stale" ? "away for a day or more: may be gone" : "",
      });
    }
    if (!theirs.length) {
      sessions.push({
        side: "peer",
        who: petname,
        session: "",
        presence: ctx.roster ? "gone" : "unknown",
        seen_at: null,
        host: "",
        where: "",
        summary: "",
        note: ctx.roster ? "no session on any roster" : "no relay answered the roster",
      });
    }
  }
  const rank = (p: BoardPresence) => ["live", "away", "unknown", "gone"].indexOf(p);
  sessions.sort((a, b) => rank(a.presence) - rank(b.presence) || (b.seen_at ?? 0) - (a.seen_at ?? 0));

  const rows = mine.flatMap((s) => [...s.state.tasks.values()].filter((t) => !t.moved_to).map((t) => ({ s, t })));
  rows.sort((a, b) => b.t.last_at - a.t.last_at);
  const itemsOf = (s: FoldedSession, t: TaskRow): { items: BoardItem[]; elided: number } => {
    const tl = fold.timelines.get(taskKey(t.peer_key, t.task_id));
    if (!tl) return { items: [], elided: 0 };
    const ours = [tl.first, ...tl.rest].filter((i) => fold.finalSession(i.session) === s.id);
    return { items: ours, elided: Math.max(0, tl.count - 1 - tl.rest.length) };
  };
  const delivery = (i: BoardItem): string | undefined => {
    if (i.dir === "in") return undefined;
    const state = fold.sessions.get(i.session)?.state;
    const e = state?.outgoing.get(i.msg_id);
    if (!e) return state?.pending.has(i.msg_id) ? "queued" : undefined;
    if (e.refusedBy) return `refused: ${refusalWords(e.refusedBy)}`;
    if (e.refused) return `refused: ${boardText(e.refused)}`;
    return e.shown ? "shown to their model" : e.delivered ? "delivered" : e.sentAt ? "sent" : "queued";
  };
  const tasks: BoardView["tasks"] = rows.slice(0, BOARD_TASKS_MAX).map(({ s, t }) => {
    const peer = name(t.peer_key);
    const { items, elided } = itemsOf(s, t);
    const last = t.last_out_msg_id ? s.state.outgoing.get(t.last_out_msg_id) : undefined;
    const forwarded = t.awaiting.find((q) => q.asked_by === "peer" && q.forwarded)?.forwarded;
    const open = t.awaiting.filter((q) => !q.forwarded);
    return {
      session: s.id,
      task_id: boardText(t.task_id),
      peer,
      peer_session: t.peer_session === undefined ? null : boardText(t.peer_session, 128),
      requested_by: t.requested_by === "me" ? "you" : peer,
      status: t.status,
      closed: t.closed,
      blocked_on: t.closed
        ? null
        : open.some((q) => q.asked_by === "peer")
        ? { who: "you", why: `${peer} asked a question` }
        : forwarded
        ? { who: ownerSaid(t), why: `${peer}'s question, forwarded to ${name(forwarded.to)}` }
        : t.awaiting.length
        ? { who: peer, why: "your question waits for their answer" }
        : t.requested_by === "me"
        ? { who: peer, why: "working on it" }
        : { who: `your session ${s.id}`, why: "working on it" },
      parent: t.parent
        ? {
          task_id: boardText(t.parent.task_id),
          requester: name(t.parent.requester),
          owner: name(taskOwner(t, fold.selfKey)),
          // Which task of whom a peer's task serves is that peer's word; so is an owner past who asked.
          word: t.requested_by === "peer" ? peer : claim(t),
        }
        : null,
      last_at: t.last_at,
      messages: t.messages,
      note: t.peer_closed_at && !t.closed
        ? `${peer}'s session closed: the task may not finish`
        : last?.refusedBy
        ? `${peer} refused your last message: ${refusalWords(last.refusedBy)}`
        : "",
      timeline: items.map((i) => ({ ...i, ...some("delivery", delivery(i)) })),
      elided,
    };
  });

  const waiting: BoardView["waiting"] = [];
  for (const { s, t } of rows) {
    if (t.requested_by !== "me") continue;
    const peer = name(t.peer_key);
    const to = peers.byKey.get(t.peer_key) ?? t.peer_key;
    // A question forwarded up the chain waits on the owner's human, not on you.
    for (const q of t.awaiting.filter((q) => q.asked_by === "peer" && !q.forwarded)) {
      const asked = itemsOf(s, t).items.find((i) => i.dir === "in" && i.msg_id === q.msg_id);
      const channel = t.peer_session ? ["--channel", t.peer_session] : []; // the peer's session the task lives in
      waiting.push({
        kind: "question",
        at: asked?.at ?? q.at ?? t.last_at,
        session: s.id,
        peer,
        task_id: boardText(t.task_id),
        msg_id: boardText(q.msg_id),
        text: asked?.text ??
          (q.text === undefined
            ? "(its text is no longer in the board's memory: `interlink.ts log` has it)"
            : boardText(q.text)),
        owner: t.owner === undefined || t.owner === fold.selfKey ? "you" : ownerSaid(t),
        say: `answer ${peer}'s question ${showId(q.msg_id)} on task ${showId(t.task_id)}: <your answer>`,
        command: cli(
          ["send", to, "<your answer>", "--task", t.task_id, "--in-reply-to", q.msg_id, "--session", s.id, ...channel],
          ["key", "peers", "url", "state"],
        ),
      });
    }
  }
  for (const s of mine) {
    for (const [key, k] of s.state.knocksIn) {
      if (now - k.at > FRESH_PAST_MS) continue;
      let petname = "PETNAME";
      try {
        petname = newPeerName(peers, key, undefined, k.name.replace(/ /g, "-"));
      } catch {
        // every suggestion taken: the operator picks one
      }
      waiting.push({
        kind: "knock",
        at: k.at,
        session: s.id,
        fingerprint: fingerprint(key),
        name: boardText(k.name, 64),
        say: `accept the pair request from ${fingerprint(key)} as petname ${petname}`,
        say_reject: `reject the pair request from ${fingerprint(key)}`,
        command: cli(["peers", "add", petname, key], ["peers"]),
      });
    }
  }
  waiting.sort((a, b) => b.at - a.at);

  // The oldest BOARD_LIST_MAX queued messages of all sessions are listed; the rest are counted.
  const queued: [OutEntry, FoldedSession][] = []; // (receipts: bookkeeping)
  for (const s of mine) for (const e of s.state.pending.values()) if (e.msg.kind !== "receipt") queued.push([e, s]);
  queued.sort((a, b) => a[0].at - b[0].at);
  const outbox: BoardView["delivery"]["outbox"] = queued.slice(0, BOARD_LIST_MAX).map(([e, s]) => {
    const text = e.msg.text;
    const session = parseRoute(e.recipient).session;
    return {
      at: e.at,
      session: s.id,
      to: `${name(e.msg.to)}${session ? ` (session ${boardText(session, 128)})` : ""}`,
      task_id: boardText(e.msg.task_id ?? ""),
      msg_id: e.msg.msg_id,
      text: e.msg.kind === "message" ? boardText(text, 80) : `(${e.msg.kind})`,
      note: s.live
        ? "its session retries it until a relay takes it"
        : "its session is not running: the next session of this node takes it over and sends it",
    };
  });

  const newestFirst = <T>(list: T[], named: (x: T) => T) => [...list].reverse().map(named);
  const num = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const executors = (Array.isArray(ctx.executors) ? ctx.executors : []).slice(0, BOARD_LIST_MAX).map((x) => {
    const r = (x ?? {}) as Record<string, unknown>, text = (v: unknown, max = 120) => boardText(String(v ?? ""), max);
    const denials = Array.isArray(r.denials) ? r.denials.slice(-BOARD_TIMELINE_MAX).map((d) => text(d, 240)) : [];
    const [pid, started, turns, cost] = [num(r.pid), num(r.started), num(r.turns), num(r.cost)];
    const [host, state, cwd] = [text(r.host, 16), text(r.state, 16), text(r.cwd, 240)];
    return { peer: text(r.peer), task: text(r.task), host, state, pid, cwd, started, turns, cost, denials };
  });
  return {
    now,
    node: { fingerprint: fingerprint(fold.selfKey), state: fold.root, relays: ctx.relays },
    problems: ctx.problems.map((p) => boardText(p, 400)),
    sessions: sessions.slice(0, BOARD_SESSIONS_MAX),
    tasks,
    waiting: waiting.slice(0, BOARD_LIST_MAX),
    delivery: {
      outbox,
      by_reason: [...fold.byReason].map(([reason, count]) => ({ reason, count })).sort((a, b) => b.count - a.count),
      refusals: newestFirst(fold.refusals, (r) => ({ ...r, who: r.who && name(r.who) })),
      receipts: newestFirst([...fold.receipts.values()], (r) => ({ ...r, peer: name(r.peer) })),
    },
    executors,
    totals: {
      sessions: sessions.length,
      tasks: rows.length,
      open: rows.filter((r) => !r.t.closed).length,
      waiting: waiting.length,
      outbox: queued.length,
    },
  };
}

/** `serve`'s executors.json (replaced whole on each change: never read torn); none when no serve runs here. */
function readExecutors(stateDir: string): unknown {
  try {
    return JSON.parse(fs.readFileSync(path.join(stateDir, "executors.json"), "utf8"));
  } catch {
    return [];
  }
}

/** Headers on every board answer: nothing cached, sniffed, framed, or told where it came from. */
const BOARD_HEADERS = {
  "cache-control": "no-store",
  "x-content-type-options": "nosniff",
  "referrer-policy": "no-referrer",
  "x-frame-options": "DENY",
  "cross-origin-resource-policy": "same-origin",
};

/** Two secrets compared in time that does not depend on where they differ. */
function sameSecret(a: string, b: string): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return diff === 0;
}

/** An open event stream: its controller, and how to wake it when a new snapshot is ready. */
interface BoardClient {
  controller: ReadableStreamDefaultController<Uint8Array>;
  wake(): void;
}

/**
 * The board's shell: the fold kept current, the roster re-read, and the HTTP
 * handler (`handle`) that serves the page and its events. `port` is the one
 * it answers for (set by listen; a test sets it to call `handle` directly).
 */
export class Board {
  readonly token = b64urlEncode(crypto.getRandomValues(new Uint8Array(32)));
  port = 0;
  readonly fold: BoardFold;
  #snapshot = "";
  #version = 0;
  #roster: PeerSession[] | null = null;
  #problems: string[] = ["the roster has not been read yet"];
  #clients = new Set<BoardClient>();
  #watchers = new Map<string, fs.FSWatcher>();
  #timers: ReturnType<typeof setInterval>[] = [];
  #debounce: ReturnType<typeof setTimeout> | undefined;
  #server: Listening | null = null;
  #closed = false;

  constructor(
    readonly opts: {
      stateDir: string;
      peersFile: string;
      selfKey: string;
      relays: Relay[];
      cli?: BoardContext["cli"];
      only?: string;
      now?: () => number;
    },
  ) {
    this.fold = new BoardFold(opts.stateDir, opts.selfKey, opts.now);
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}/?t=${this.token}`;
  }

  /** Binds 127.0.0.1:`port` (0: a free one) and starts following the journals and the roster. */
  async listen(port: number): Promise<void> {
    this.#server = await serveHttp((req) => Promise.resolve(this.handle(req)), "127.0.0.1", port);
    this.port = this.#server.port;
    this.start();
  }

  /** Follows the journals (fs.watch, re-checked every BOARD_RECHECK_MS) and the roster (every BOARD_TICK_MS). */
  start(): void {
    this.refresh(true);
    void this.readRoster();
    this.#timers.push(setInterval(() => this.refresh(), BOARD_RECHECK_MS));
    this.#timers.push(setInterval(() => void this.readRoster(), BOARD_TICK_MS));
  }

  /** Folds what changed and, if anything did (or `force`), publishes a new snapshot to every open stream. */
  refresh(force = false): void {
    if (this.#closed) return;
    const changed = this.fold.catchUp();
    this.#watch();
    if (!changed && !force) return;
    let peers = EMPTY_PEERS;
    const problems = [...this.#problems];
    try {
      peers = loadPeers(this.opts.peersFile);
    } catch (e) {
      problems.push((e as Error).message);
    }
    const view = boardView(this.fold, {
      now: (this.opts.now ?? Date.now)(),
      peers,
      roster: this.#roster,
      problems,
      relays: this.opts.relays.map((r) => redactUrl(r.name)),
      ...some("only", this.opts.only),
      ...some("cli", this.opts.cli),
      executors: readExecutors(this.opts.stateDir),
    });
    this.#snapshot = JSON.stringify(view);
    this.#version++;
    for (const c of this.#clients) c.wake();
  }

  async readRoster(): Promise<void> {
    try {
      const { byRoute, problems } = await readRoster(this.opts.relays, (this.opts.now ?? Date.now)());
      [this.#roster, this.#problems] = [[...byRoute.values()], problems];
    } catch (e) {
      [this.#roster, this.#problems] = [null, [`roster: ${errorText(e)}`]];
    }
    this.refresh(true);
  }

  /** A watcher on the sessions folder and on each folded session's (bounded by the fold's folders). */
  #watch(): void {
    const dirs = new Set([
      path.join(this.opts.stateDir, "sessions"),
      ...[...this.fold.sessions.values()].map((s) => s.dir),
    ]);
    for (const [dir, w] of this.#watchers) if (!dirs.has(dir)) w.close(), this.#watchers.delete(dir);
    for (const dir of dirs) {
      if (this.#watchers.has(dir) || !fs.existsSync(dir)) continue; // not there yet: a later re-check watches it
      try {
        const w = fs.watch(dir, () => this.#soon());
        // Removed meanwhile (Deno reports that as an error event): dropped, and watched again if it comes back.
        w.on("error", () => (w.close(), this.#watchers.delete(dir)));
        this.#watchers.set(dir, w);
      } catch {
        // removed between the check and the watch
      }
    }
  }

  #soon(): void {
    clearTimeout(this.#debounce);
    this.#debounce = setTimeout(() => this.refresh(), BOARD_DEBOUNCE_MS);
  }

  /**
   * The HTTP handler: GET / (the page) and GET /events (the snapshots), for the token's holder only. The Host is
   * compared as a string before anything is parsed, and a request whose URL does not parse is a 400: nothing a
   * client sends reaches a runtime's error page.
   */
  handle(req: Request): Response {
    const hosts = [`127.0.0.1:${this.port}`, `localhost:${this.port}`];
    if (!hosts.includes(req.headers.get("host") ?? "")) {
      return new Response("forbidden\n", { status: 403, headers: BOARD_HEADERS });
    }
    let url: URL;
    try {
      url = new URL(req.url);
    } catch {
      return new Response("bad request\n", { status: 400, headers: BOARD_HEADERS });
    }
    const origin = req.headers.get("origin");
    const allowed = (origin === null || hosts.some((h) => origin === `http://${h}`)) &&
      sameSecret(url.searchParams.get("t") ?? "", this.token);
    if (!allowed) return new Response("forbidden\n", { status: 403, headers: BOARD_HEADERS });
    if (req.method !== "GET") return new Response("only GET\n", { status: 405, headers: BOARD_HEADERS });
    if (url.pathname === "/") return this.#page();
    if (url.pathname === "/events") return this.#events(req);
    return new Response("not found\n", { status: 404, headers: BOARD_HEADERS });
  }

  #page(): Response {
    const nonce = b64urlEncode(crypto.getRandomValues(new Uint8Array(16)));
    const csp = `default-src 'none'; script-src 'nonce-${nonce}'; style-src 'nonce-${nonce}'; connect-src 'self'; ` +
      "img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
    return new Response(BOARD_PAGE.replaceAll("__NONCE__", nonce), {
      headers: { ...BOARD_HEADERS, "content-type": "text/html; charset=utf-8", "content-security-policy": csp },
    });
  }

  /**
   * Server-sent events: the current snapshot, then each newer one. A stream is
   * pulled: a slow reader gets the newest snapshot when it is ready for one,
   * never a queue of old ones, so each client costs one snapshot at most.
   */
  #events(req: Request): Response {
    if (this.#clients.size >= BOARD_CLIENTS_MAX || this.#closed) {
      return new Response("too many open boards\n", { status: 503, headers: BOARD_HEADERS });
    }
    let sent = 0;
    let client: BoardClient | undefined;
    let waiting: (() => void) | null = null;
    const drop = () => {
      if (client) this.#clients.delete(client);
      waiting?.();
    };
    const body = new ReadableStream<Uint8Array>({
      start: (controller) => {
        client = { controller, wake: () => waiting?.() };
        this.#clients.add(client);
        controller.enqueue(utf8.encode("retry: 2000\n\n"));
      },
      pull: async (controller) => {
        while (sent === this.#version && !this.#closed && client && this.#clients.has(client)) {
          await new Promise<void>((resolve) => (waiting = resolve));
          waiting = null;
        }
        if (this.#closed || !client || !this.#clients.has(client)) return controller.close();
        sent = this.#version;
        controller.enqueue(utf8.encode(`event: snapshot\ndata: ${this.#snapshot}\n\n`));
      },
      cancel: drop,
    }, { highWaterMark: 0 });
    req.signal.addEventListener("abort", drop);
    return new Response(body, {
      headers: { ...BOARD_HEADERS, "content-type": "text/event-stream; charset=utf-8" },
    });
  }

  async close(): Promise<void> {
    this.#closed = true;
    for (const t of this.#timers) clearInterval(t);
    clearTimeout(this.#debounce);
    for (const w of this.#watchers.values()) w.close();
    for (const c of this.#clients) {
      c.wake();
      try {
        c.controller.close();
      } catch {
        // already closed by its reader
      }
    }
    this.#clients.clear();
    await this.#server?.stop();
    await Promise.all(this.opts.relays.map((r) => r.close()));
  }
}

/** A board for a node's folders and relays, listening: what `interlink.ts board` and `demo --board` run. */
export async function openBoard(
  node: { stateDir: string; peersFile: string; busUrls: string[]; selfKey: string },
  port: number,
  opts: { cli?: BoardContext["cli"]; only?: string } = {},
): Promise<Board> {
  const relays = node.busUrls.map((url) => openRelay(url, undefined, undefined, node.selfKey));
  const board = new Board({ ...node, relays, ...opts, now: nodeClock() });
  await board.listen(port);
  return board;
}

// The page: plain HTML, CSS and a little JavaScript, served with a fresh nonce
// in its CSP (no other script or style runs). The script reads the token from
// its own URL, opens /events with it, and on each snapshot replaces what it
// shows: it keeps no history, so a page open for a day holds one view. Every
// string from the view is set as text (append of a string, textContent).
const BOARD_PAGE = `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>interlink board</title>
<style nonce="__NONCE__">
:root { color-scheme: light dark; --bg: #f5f6f8; --card: #fff; --ink: #1c222b; --dim: #5f6b78; --line: #dde2e8;
  --blue: #2563eb; --amber: #b45309; --green: #15803d; --red: #b91c1c; --grey: #6b7280; }
@media (prefers-color-scheme: dark) { :root { --bg: #101317; --card: #191e25; --ink: #e6e9ee; --dim: #9aa4b0;
  --line: #2a313b; --blue: #3b82f6; --amber: #d97706; --green: #16a34a; --red: #dc2626; --grey: #6b7280; } }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, sans-serif; background: var(--bg); color: var(--ink);
  overflow-wrap: anywhere; }
header { display: flex; flex-wrap: wrap; gap: 2px 14px; align-items: baseline; padding: 10px 16px;
  background: var(--card); border-bottom: 1px solid var(--line); }
h1 { font-size: 16px; margin: 0; }
main { display: grid; grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); gap: 14px; padding: 14px; }
#waiting { grid-column: 1 / -1; }
.side { display: flex; flex-direction: column; gap: 14px; min-width: 0; }
@media (max-width: 700px) { main { grid-template-columns: minmax(0, 1fr); gap: 8px; padding: 8px; }
  .side { gap: 8px; } }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px;
  min-width: 0; }
h2 { font-size: 12px; text-transform: uppercase; letter-spacing: .05em; color: var(--dim); margin: 0 0 6px; }
h3 { font-size: 13px; margin: 10px 0 2px; }
.card { border-top: 1px solid var(--line); padding: 8px 0; }
.card:first-child { border-top: 0; padding-top: 2px; }
.row { display: flex; flex-wrap: wrap; gap: 2px 8px; align-items: baseline; }
.dim { color: var(--dim); font-size: 12px; }
.chip { display: inline-block; border-radius: 999px; padding: 0 8px; font-size: 12px; font-weight: 600;
  color: #fff; background: var(--grey); white-space: nowrap; }
.update, .delivered { background: var(--blue); } .needs_input, .away, .knock { background: var(--amber); }
.result, .live, .shown { background: var(--green); } .failed, .refused, .gone { background: var(--red); }
ol { list-style: none; margin: 6px 0 0; padding: 0 0 0 10px; border-left: 2px solid var(--line); }
li { margin: 3px 0; }
.text { white-space: pre-wrap; }
pre { font: 12px/1.4 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; margin: 3px 0 6px;
  padding: 5px 8px; background: var(--bg); border: 1px solid var(--line); border-radius: 6px; }
.ask { border-left: 3px solid var(--amber); padding-left: 8px; margin: 4px 0; }
.empty { color: var(--dim); font-style: italic; margin: 2px 0; }
.problem { color: var(--red); }
#conn.down { color: var(--red); }
</style>
</head>
<body>
<header><h1>interlink board</h1><span id="node" class="dim"></span><span id="conn" class="dim">connecting…</span></header>
<main>
<section id="waiting"><h2>Waiting on you</h2><div></div></section>
<section id="tasks"><h2>Tasks</h2><div></div></section>
<div class="side">
<section id="sessions"><h2>Sessions</h2><div></div></section>
<section id="delivery"><h2>Delivery</h2><div></div></section>
</div>
</main>
<script nonce="__NONCE__">
"use strict";
const token = new URLSearchParams(location.search).get("t") || "";
function h(tag, cls, ...kids) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  for (const k of kids) if (k !== null && k !== undefined && k !== "") e.append(k); // a string becomes a text node
  return e;
}
let now = 0;
function ago(ms) {
  const s = Math.max(0, Math.round((now - ms) / 1000));
  return s < 90 ? s + " s ago" : s < 5400 ? Math.round(s / 60) + " min ago"
    : s < 172800 ? Math.round(s / 3600) + " h ago" : Math.round(s / 86400) + " days ago";
}
const clock = (ms) => new Date(ms).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
const chip = (text, kind) => h("span", "chip " + (kind || text), text);
const empty = (text) => h("p", "empty", text);
const more = (shown, total, what) => total > shown ? h("p", "dim", "showing " + shown + " of " + total + " " + what) : null;
const fill = (id, ...kids) => document.querySelector("#" + id + " > div").replaceChildren(...kids.filter(Boolean));

function waitCard(w) {
  if (w.kind === "question") {
    return h("div", "card", h("div", "row", chip("needs_input"), h("strong", null, w.peer + " asks"),
        h("span", null, "on task " + w.task_id), h("span", "dim", ago(w.at) + " · your session " + w.session +
          (w.owner !== "you" ? " · the work is " + w.owner + "'s" : ""))),
      h("div", "ask text", w.text),
      h("div", "dim", "say to your session " + w.session + ":"), h("pre", null, w.say),
      h("div", "dim", "or run:"), h("pre", null, w.command));
  }
  return h("div", "card", h("div", "row", chip("knock"), h("strong", null, w.fingerprint),
      h("span", null, "claims \\u201c" + w.name + "\\u201d (unverified) and asks to pair"),
      h("span", "dim", ago(w.at) + " · your session " + w.session)),
    h("div", "dim", "to accept, say to your session " + w.session + ":"), h("pre", null, w.say),
    h("div", "dim", "to reject:"), h("pre", null, w.say_reject),
    h("div", "dim", "or add them to your peers yourself (they are not told):"), h("pre", null, w.command));
}

function taskCard(t) {
  const items = t.timeline.map((i, n) => h("li", null, h("span", "dim", clock(i.at)), " ", i.dir === "out" ? "→ " : "← ",
    chip(i.status || (i.in_reply_to ? "answer" : n === 0 ? "request" : "message"), i.status || "none"), " ",
    h("span", "text", i.text), i.delivery ? h("span", "dim", " · " + i.delivery) : null));
  if (t.elided) items.splice(1, 0, h("li", "dim", "… " + t.elided + " more"));
  return h("div", "card",
    h("div", "row", chip(t.status || "requested", t.status || "none"), h("strong", null, "task " + t.task_id),
      h("span", null, "with " + t.peer + (t.peer_session ? " (session " + t.peer_session + ")" : "")),
      h("span", "dim", t.closed ? "closed" : "open")),
    h("div", "dim", "requested by " + t.requested_by +
      (t.parent ? " · serves task " + t.parent.task_id + " of " + t.parent.requester + ", owned by " + t.parent.owner +
        (t.parent.word ? ", by " + t.parent.word + "'s word" : "") : "") +
      (t.blocked_on ? " · waiting on " + t.blocked_on.who + ": " + t.blocked_on.why : "") +
      " · your session " + t.session + " · " + t.messages + " messages, last " + ago(t.last_at)),
    t.note ? h("div", "problem", t.note) : null,
    items.length ? h("ol", null, ...items) : null);
}

function sessionCard(s) {
  return h("div", "card", h("div", "row", chip(s.presence), h("strong", null, s.who),
      h("span", null, s.session ? "session " + s.session : ""), h("span", "dim", s.host)),
    h("div", "dim", [s.where, s.summary && "\\u201c" + s.summary + "\\u201d",
      s.seen_at ? "seen " + ago(s.seen_at) : "", s.note].filter(Boolean).join(" · ")));
}

function render(v) {
  now = v.now;
  document.getElementById("node").textContent = "node " + v.node.fingerprint + " · " + v.node.state + " · " +
    v.node.relays.join(", ") + " · " + v.totals.open + " open of " + v.totals.tasks + " tasks";
  fill("waiting", ...v.problems.map((p) => h("p", "problem", p)),
    ...(v.waiting.length ? v.waiting.map(waitCard) : [empty("nothing waits on you")]),
    more(v.waiting.length, v.totals.waiting, "items"));
  fill("tasks", ...(v.tasks.length ? v.tasks.map(taskCard) : [empty("no tasks yet")]),
    more(v.tasks.length, v.totals.tasks, "tasks"));
  fill("sessions", ...(v.sessions.length ? v.sessions.map(sessionCard) : [empty("no sessions yet")]),
    more(v.sessions.length, v.totals.sessions, "sessions"),
    v.executors.length ? h("h3", null, "Executors (interlink.ts serve)") : null,
    ...v.executors.map((x) => h("div", "card", h("div", "row", chip(x.state), h("strong", null, x.peer),
        h("span", null, "task " + x.task), h("span", "dim", x.host + (x.pid ? " · pid " + x.pid : "") + " · " + x.cwd +
          (x.started ? " · started " + clock(x.started) : "") + " · " + (x.turns || 0) + " turns" +
          (x.cost !== null ? " · $" + x.cost.toFixed(4) : ""))),
      ...x.denials.map((d) => h("div", "dim text", "denied: " + d)))));
  const d = v.delivery;
  fill("delivery",
    h("h3", null, "Outbox (" + v.totals.outbox + ")"),
    ...(d.outbox.length ? d.outbox.map((o) => h("div", "card", h("div", "row", h("strong", null, "→ " + o.to),
        o.task_id ? h("span", null, "task " + o.task_id) : null, h("span", "dim", "queued " + ago(o.at))),
      h("div", "text", o.text), h("div", "dim", "your session " + o.session + ": " + o.note))) : [empty("empty")]),
    h("h3", null, "Refusals"),
    d.by_reason.length ? h("div", "row", ...d.by_reason.map((r) => chip(r.reason + " × " + r.count, "none"))) : null,
    ...(d.refusals.length ? d.refusals.map((r) => h("div", "card dim", clock(r.at) + " · " +
      (r.dir === "in" ? "we refused " + r.who : r.dir === "out" ? r.who + " refused ours" : "every relay refused ours to " + r.who) +
      ": " + r.reason + (r.detail ? " (" + r.detail + ")" : ""))) : [empty("none")]),
    h("h3", null, "Receipts"),
    ...(d.receipts.length ? d.receipts.map((r) => h("div", "card",
      h("div", "row", chip(r.state), h("strong", null, r.peer), r.task_id ? h("span", null, "task " + r.task_id) : null,
        h("span", "dim", [r.delivered && "delivered " + clock(r.delivered), r.shown && "shown to their model " +
          clock(r.shown), r.detail].filter(Boolean).join(" · "))),
      h("div", "dim text", r.text))) : [empty("none yet")]));
}

const conn = document.getElementById("conn");
const events = new EventSource("/events?t=" + encodeURIComponent(token));
events.addEventListener("snapshot", (e) => {
  render(JSON.parse(e.data));
  conn.textContent = "live · updated " + clock(Date.now());
  conn.className = "dim";
});
events.onerror = () => { conn.textContent = "reconnecting…"; conn.className = "dim down"; };
</script>
</body>
</html>
`;

/**
 * `board`: the live page of every session of this identity on this machine (or --session's), until SIGINT or
 * SIGTERM. The commands it prints carry the settings given here as flags, so they reach the same node.
 */
async function runBoard(o: Options, _pos: string[], from: OptionSources): Promise<number> {
  setLogComponent("interlink board");
  const { cfg, id } = await nodeConfig(o);
  const port = intOption(o.port, "port", 0, 65535);
  const only = from.session === "default" && from.inbox === "default" ? undefined : cfg.session;
  const cli: BoardContext["cli"] = {};
  for (const k of ["key", "peers", "url", "state"] as const) if (from[k] === "flag") cli[k] = String(o[k]);
  const stopped = shutdownSignal();
  let board: Board;
  try {
    board = await openBoard({ ...cfg, selfKey: id.publicKey }, port, { cli, ...some("only", only) });
  } catch (e) {
    throw new InterlinkError(`cannot listen on 127.0.0.1:${port}: ${(e as Error).message}`);
  }
  print(`interlink board of ${id.fingerprint} (state ${cfg.stateDir}${only ? `, session ${only}` : ""}):`);
  print(board.url);
  print("Open it in a browser on this machine: whoever has this URL can read the board. Ctrl-C stops it.");
  logInfo(`${await stopped}: shutting down`);
  await board.close();
  return 0;
}

export const command: CommandSpec = {
  summary: EXTRAS["board"].summary,
  about: "Serves one page on 127.0.0.1 and prints its URL, which carries a random token: without it every request\n" +
    "is refused (403). It follows the journals of every session of this node on this machine (--session: one)\n" +
    "and the roster, and only reads: no lock, no announcement, nothing sent or written. Serves until Ctrl-C.",
  options: {
    ...NODE_OPTIONS,
    port: {
      type: "string",
      arg: "PORT",
      env: "INTERLINK_BOARD_PORT",
      default: "0",
      help: "TCP port on 127.0.0.1; 0 picks a free one",
    },
  },
  run: runBoard,
};

if (import.meta.main) runExtra("board", command);
