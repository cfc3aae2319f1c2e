/**
 * extras/doctor.ts: `interlink.ts doctor`, which checks a node's set-up and says how to fix what is wrong: the
 * runtime, the key file and its mode, peers.json, the node's sessions (which run, the last server start, Codex
 * wakes), the last day's refusals and clock skew, lines set aside as unreadable, and every relay it is configured
 * with (reachability, round trip, clock, its roster; a NATS stream's limits, through nats.ts). It only reads: what a
 * session writes for it (last-start.json, wake.json, session.json) is written by the node.
 */

import * as fs from "node:fs";
import * as path from "node:path";
import {
  busDataDir,
  type CommandSpec,
  corruptCount,
  corruptFile,
  defaultNodeState,
  errorText,
  EXTRAS,
  FRESH_PAST_MS,
  type Identity,
  isNatsUrl,
  isObject,
  journalFiles,
  lastStartFile,
  listSessions,
  loadPeers,
  localBusUrl,
  NODE_OPTIONS,
  type Options,
  parseBusUrls,
  print,
  readIdentity,
  readJsonAnswer,
  type ReceiptLine,
  recordedReports,
  refusalWords,
  ROSTER_ANSWER_MAX_BYTES,
  ROSTER_ANSWER_VALUES_MAX,
  runExtra,
  runtimeName,
  scanJournal,
  SEND_WINDOW,
  sessionLabel,
  showInvisible,
  SLOW_START_MS,
  some,
  VERSION,
} from "../interlink.ts";
import { NATS_ROSTER, NATS_STREAM, NatsRelay, withTimeout } from "../nats.ts";

type Finding = { level: "ok" | "info" | "problem"; what: string; fix?: string };

/** What doctor found: a fact, a fact with a hint, or a problem and how to fix it. */
const found = {
  ok: (what: string): Finding => ({ level: "ok", what }),
  info: (what: string, fix?: string): Finding => ({ level: "info", what, ...some("fix", fix) }),
  problem: (what: string, fix: string): Finding => ({ level: "problem", what, fix }),
};

/** Largest clock difference to the bus that `doctor` calls fine: well inside the 60 s future window. */
const SKEW_WARN_MS = 10_000;

/**
 * What a relay does at a route's cap (see QUEUE_CAP in interlink.ts): refuse the next, so nothing accepted is lost;
 * or drop the oldest (`which` relay that is, and the `fix`), so our senders hold back by receipts.
 */
function fullFinding(relay: string, refuses: boolean, cap: string, which: string, fix: string): Finding {
  return refuses
    ? found.ok(`${relay} refuses a message past ${cap} (the sender keeps it): nothing accepted is dropped`)
    : found.info(
      `${relay} drops the oldest message past ${cap} (${which}): our senders hold each route at ${SEND_WINDOW} unconfirmed, freed by receipts; a reference node, which sends none, is not held and can lose mail there`,
      fix,
    );
}

/** The last server start's timing, as the session recorded it (recordStart): past SLOW_START_MS, a problem. */
function lastStartFinding(stateDir: string): Finding | null {
  let last: { ms?: unknown; at?: unknown; runtime?: unknown };
  try {
    last = JSON.parse(fs.readFileSync(lastStartFile(stateDir), "utf8"));
  } catch {
    return null; // no server has started here yet (or the record is unreadable: it is only a report)
  }
  if (typeof last.ms !== "number" || typeof last.at !== "number") return null;
  const what = `the last server start (${String(last.runtime)}, ${new Date(last.at).toISOString()}) answered after ${
    (last.ms / 1000).toFixed(1)
  } s; Claude Code waits 30 s (MCP_TIMEOUT)`;
  return last.ms > SLOW_START_MS
    ? found.problem(
      what,
      "use a local copy of interlink.ts (not a URL) and restart the session; on a slow machine start claude with MCP_TIMEOUT=60000",
    )
    : found.ok(what);
}

/** A NATS relay: it connects, JetStream is on, the stream and roster bucket exist or could be made, its round trip. */
async function doctorNats(url: string, id: Identity | null): Promise<Finding[]> {
  const relay = new NatsRelay(url, undefined, id?.publicKey);
  const name = `NATS relay ${relay.name}`;
  try {
    const t0 = Date.now();
    const link = await withTimeout(5_000, `${relay.name}: connect`, () => relay.link());
    const setupMs = Date.now() - t0;
    const rtt = await withTimeout(5_000, `${relay.name}: ping`, () => link.nc.rtt());
    const mine = id && (await relay.roster()).some((a) => isObject(a) && a.pubkey === id.publicKey);
    return [
      found.ok(
        `${name} answers (round trip ${rtt} ms; connected with JetStream, stream ${NATS_STREAM} and bucket ${NATS_ROSTER} ready, in ${setupMs} ms)`,
      ),
      found.info(
        `${name}: who may read or ack a route is up to the account's permissions (docs/nats.md, "Who may read a route"), not to interlink`,
      ),
      fullFinding(
        name,
        link.refuses,
        "its per-subject limit",
        "a stream made by an earlier release",
        'once no node of an earlier release uses it: `nats stream edit INTERLINK --discard new --discard-per-subject` (docs/nats.md, "Mapping")',
      ),
      ...(id
        ? [
          found.info(
            `this node is ${mine ? "" : "not "}on the roster of ${relay.name}${
              mine ? "" : " (no agent running with this key)"
            }`,
          ),
        ]
        : []),
    ];
  } catch (e) {
    return [
      found.problem(
        `${name} is not usable: ${errorText(e)}`,
        "start nats-server with JetStream (`nats-server -js`), check the URL and credentials (INTERLINK_NATS_CREDS, INTERLINK_NATS_NKEY, INTERLINK_NATS_CA)",
      ),
    ];
  } finally {
    await relay.close();
  }
}

async function doctorFindings(o: Options): Promise<Finding[]> {
  const out = [found.ok(`runtime ${runtimeName()}, interlink ${VERSION}, ${process.platform}`)];
  const keyFile = o.key as string;
  let id: Identity | null = null;
  try {
    id = await readIdentity(keyFile);
    const mode = fs.statSync(keyFile).mode & 0o777;
    out.push(
      mode & 0o077
        ? found.problem(`key file ${keyFile} is readable by others (mode ${mode.toString(8)})`, `chmod 600 ${keyFile}`)
        : found.ok(`key file ${keyFile} (mode 600), fingerprint ${id.fingerprint}`),
    );
  } catch (e) {
    out.push(found.problem((e as Error).message.replace(/ Create one.*$/, ""), `interlink.ts keygen --out ${keyFile}`));
  }
  const peersFile = o.peers as string;
  try {
    const names = [...loadPeers(peersFile).byName.keys()];
    out.push(
      fs.existsSync(peersFile)
        ? found.ok(`peers.json ${peersFile}: ${names.length} peer(s)${names.length ? ` (${names.join(", ")})` : ""}`)
        : found.info(
          `no peers.json at ${peersFile} yet`,
          "pair with the discover and request_pair tools, or `interlink.ts peers add PETNAME KEY`",
        ),
    );
  } catch (e) {
    const fix = `edit ${peersFile}: { "<petname>": { "key": "<43-char public key>" } }, one key per petname`;
    out.push(found.problem((e as Error).message, fix));
  }
  const state = (o.state as string | undefined) ?? (id ? defaultNodeState(id.fingerprint) : undefined);
  const sessions = state ? listSessions(state) : [];
  const live = sessions.filter((x) => x.live);
  if (state) {
    const lastStart = lastStartFinding(state);
    if (lastStart) out.push(lastStart);
    out.push(
      live.length
        ? found.ok(
          `state folder ${state}: ${live.length} session(s) running: ${
            live.map((x) => `${sessionLabel(x)} pid ${x.live!.pid}`).join(", ")
          }`,
        )
        : found.info(`state folder ${state}: no session running (${sessions.length} known)`),
    );
  }
  for (const x of live) {
    // A relay that refused the session's announcement, in the relay's words as the session recorded them.
    const unlisted = (x.info as { unlisted?: unknown }).unlisted;
    for (const [relay, why] of Object.entries(isObject(unlisted) ? unlisted : {})) {
      out.push(found.problem(
        `session ${sessionLabel(x)} is not on the roster of ${showInvisible(relay)}: ${showInvisible(String(why))}`,
        "peers cannot find it there: end the sessions of this node you no longer use, or ask that relay's operator for room",
      ));
    }
    // A Codex session's last wake: a queue that failed says why (what waits stays for check_inbox).
    try {
      const wake = JSON.parse(fs.readFileSync(path.join(x.dir, "wake.json"), "utf8"));
      if (isObject(wake) && wake.ok === false) {
        out.push(found.problem(
          `the Codex session ${sessionLabel(x)} cannot be woken: ${showInvisible(String(wake.why))}`,
          "check that codex runs (INTERLINK_CODEX_BIN) and that the session is a normal one (not codex exec or ephemeral); its messages wait for check_inbox",
        ));
      }
    } catch {
      // not a Codex session, or never woken
    }
  }
  const refusals = new Map<string, number>();
  const skewed = { theirs: 0, reported: 0, ours: new Map<string, ReceiptLine>() }; // the last day's clock refusals
  const since = Date.now() - FRESH_PAST_MS;
  for (const file of sessions.flatMap((x) => journalFiles(x.dir))) {
    scanJournal(file, 0, (r) => {
      if (r.t === "refusal") refusals.set(r.reason, (refusals.get(r.reason) ?? 0) + 1);
      if (r.at < since) return;
      if (r.t === "refusal" && r.reason === "stale") skewed.theirs++;
      if (r.t === "owe") skewed.reported++;
      if (r.t !== "receipt") return;
      for (const l of recordedReports(r)) if (l.state === "refused") skewed.ours.set(r.peer, l);
    });
  }
  for (const [peer, l] of skewed.ours) {
    out.push(found.problem(
      `${showInvisible(peer)} refused your messages in the last day (latest ${l.msg_id}): ${refusalWords(l)}`,
      l.reason === "not_allowlisted"
        ? `ask ${showInvisible(peer)} to pair again: the request_pair tool (a re-knock) or \`interlink.ts invite\``
        : "sync this machine's clock (NTP: `timedatectl set-ntp true`), then send what matters again",
    ));
  }
  if (skewed.theirs) {
    out.push(found.problem(
      `this node refused peers' messages for their time in the last day (a sender's clock ahead by over a minute, or held over 30 days)${
        skewed.reported ? `; ${skewed.reported} of them are reported to their senders by receipt` : ""
      }`,
      "`interlink.ts log` names each sender: ask its operator to sync its clock (NTP); check this machine's too",
    ));
  }
  if (refusals.size) {
    const list = [...refusals].map(([why, n]) => `${n} ${why}`).join(", ");
    out.push(found.info(
      `this node refused messages (${list}), one line per sender and reason`,
      "`interlink.ts log` shows each, with who sent it",
    ));
  }
  // What was set aside as unreadable, never silent: journal lines, and this machine's bus's damaged payloads (from
  // queue.db) or lines of an earlier bus's queue.jsonl it took in.
  const bus = ["queue.db", "queue.jsonl"].map((f) => path.join(busDataDir(), f));
  for (const file of [...sessions.map((x) => path.join(x.dir, "log.jsonl")), ...bus]) {
    const n = corruptCount(file);
    if (n) {
      out.push(found.problem(
        file.endsWith(".db")
          ? `${n} damaged payload(s) were set aside from ${file}, this machine's bus's queue (a disk fault)`
          : `${n} unreadable line(s) were taken out of ${file} (a disk fault or a hand edit)`,
        `read ${corruptFile(file)} (each line: its offset, why, and its text); delete it once dealt with`,
      ));
    }
  }
  let urls: string[] = [];
  try {
    urls = parseBusUrls((o.url as string | undefined) ?? localBusUrl());
  } catch (e) {
    out.push(
      found.problem((e as Error).message, "set INTERLINK_URL to comma-separated http(s)://, nats:// or tls:// URLs"),
    );
  }
  for (const url of urls) {
    if (isNatsUrl(url)) {
      out.push(...await doctorNats(url, id));
      continue;
    }
    const t0 = Date.now();
    let r: Response, roster: unknown;
    try {
      r = await fetch(`${url}/roster`, { signal: AbortSignal.timeout(3000) });
      roster = await readJsonAnswer(r, ROSTER_ANSWER_MAX_BYTES, "its roster", ROSTER_ANSWER_VALUES_MAX);
      if (!r.ok) throw new Error(`answered ${r.status}`);
    } catch (e) {
      out.push(found.problem(
        `bus ${url} is unreachable: ${errorText(e)}`,
        o.url === undefined
          ? "start one with `interlink.ts bus` (the mcp command starts one itself unless --no-bus)"
          : "start that bus, or fix INTERLINK_URL",
      ));
      continue;
    }
    const t1 = Date.now();
    const features = r.headers.get("interlink-bus") ?? "";
    out.push(
      found.ok(`bus ${url} answers (round trip ${t1 - t0} ms)`),
      features.includes("ownership")
        ? found.ok(`bus ${url} enforces recipient ownership: once a route proves its key, nobody else reads or acks it`)
        : found.info(
          `bus ${url} does not enforce recipient ownership (a reference bus): anyone who reaches it can read or ack any route`,
          "run `interlink.ts bus` there, or keep the bus on a network only your nodes reach",
        ),
      fullFinding(
        `bus ${url}`,
        features.includes("full-refused"),
        "its cap per recipient",
        "a reference bus, or ours of an earlier release",
        "run `interlink.ts bus` of this release there",
      ),
    );
    const sessions = /\bsessions=(\d+)/.exec(features)?.[1]; // what its file-descriptor limit allows (bus.ts)
    if (sessions) out.push(found.ok(`bus ${url}: its file-descriptor limit allows about ${sessions} sessions at once`));
    const date = r.headers.get("date");
    if (date) {
      const skew = Date.parse(date) - (t0 + t1) / 2; // the header has 1 s resolution
      out.push(
        Math.abs(skew) > SKEW_WARN_MS
          ? found.problem(
            `clock is ${Math.round(skew / 1000)} s off ${url}`,
            "sync this machine's clock (NTP); peers refuse messages more than 60 s in the future",
          )
          : found.ok(`clock within ${Math.max(1, Math.round(Math.abs(skew) / 1000))} s of ${url}`),
      );
    }
    if (!id) continue;
    const key = id.publicKey;
    const listed = isObject(roster) && Array.isArray(roster.roster) &&
      roster.roster.some((a) => isObject(a) && a.pubkey === key);
    out.push(
      listed ? found.ok(`this node is on the roster of ${url}`) : live.length
        ? found.problem(
          `this node is not on the roster of ${url} although an agent runs`,
          "check the agent's log (stderr) for errors reaching the bus",
        )
        : found.info(`this node is not on the roster of ${url} (no agent running with this key)`),
    );
  }
  return out;
}

async function runDoctor(o: Options): Promise<number> {
  const findings = await doctorFindings(o);
  for (const f of findings) {
    print(`${{ ok: "ok     ", info: "info   ", problem: "PROBLEM" }[f.level]}  ${f.what}`);
    if (f.fix) print(`         fix: ${f.fix}`);
  }
  const problems = findings.filter((f) => f.level === "problem").length;
  print(problems ? `\n${problems} problem(s) found.` : "\nno problems found.");
  return problems ? 1 : 0;
}

export const command: CommandSpec = {
  summary: EXTRAS["doctor"].summary,
  about:
    "Checks the runtime, the key file and its mode, peers.json, this node's sessions (which run, their last start, their\nCodex wakes), the last day's refusals and clock skew, lines set aside as unreadable, and every relay (reachability,\nround trip, clock skew, whether this node is on its roster; a NATS stream's limits). Exits 1 if any problem was found.",
  options: { ...NODE_OPTIONS },
  run: runDoctor,
};

if (import.meta.main) runExtra("doctor", command);
