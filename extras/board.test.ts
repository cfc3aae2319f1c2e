// Tests for extras/board.ts, `interlink.ts board`: the operator's live page, read-only, for the token's holder only;
// its fold of the journal, and the page itself in headless Chromium. The core's tests are interlink.test.ts; the
// helpers they share, dev/testkit.ts.

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import {
  BOARD_LIST_MAX,
  BOARD_TASKS_MAX,
  BOARD_TEXT_MAX,
  BOARD_TIMELINE_MAX,
  BOARD_TIMELINES_CAP,
  BoardFold,
  type BoardView,
  boardView,
} from "./board.ts";
import {
  b64urlEncode,
  type Chain,
  encodeRecord,
  Journal,
  type JournalRecord,
  NodeState,
  parsePeers,
  readJsonl,
  type SignedMessage,
  type TaskStatus,
} from "../interlink.ts";
import {
  busOnLoopback,
  eve,
  eventually,
  killGroup,
  leaks,
  McpNode,
  msgIdOf,
  type NodeFiles,
  rawGet,
  runCliAsync,
  runtimeArgv,
  SCRIPT,
  spawnTracked,
  sweepAfterAll,
  systemTool,
  tmpDir,
  twoPeers,
  untilLine,
} from "../dev/testkit.ts";

sweepAfterAll();

// ----------------------------------------------------------------------------
// The board in a real browser: headless Chromium (Debian's chromium; CI installs it), driven over the DevTools
// protocol on its own WebSocket, with no npm browser driver. Without chromium the browser tests are skipped, and
// the suite says which and the line that installs it.

const BOARD_BROWSER_TESTS = [
  "rows appear and change live, without a reload, as two real agents run a task; a question waits on you until answered",
  "markup, scripts and bidi characters in a peer's message and task id render as text",
  "the page fits a 400 px window: one column, nothing wider than the screen",
  "demo --board keeps alice's board up; a screenshot of it is saved",
];
const CHROMIUM = systemTool("chromium", "/usr/bin/chromium", "board", BOARD_BROWSER_TESTS);
const browserTest = test.skipIf(!CHROMIUM);

// deno-lint-ignore no-explicit-any -- a DevTools protocol result, read for the fields its method returns
type CdpResult = Record<string, any>;

/** One headless Chromium and one page in it, driven over the DevTools protocol (flat sessions on one WebSocket). */
class Chromium {
  #ws!: WebSocket;
  #next = 0;
  #calls = new Map<number, { resolve(v: CdpResult): void; reject(e: Error): void }>();
  #page = "";
  #proc!: ReturnType<typeof spawnTracked>;

  static async start(): Promise<Chromium> {
    const c = new Chromium();
    c.#proc = spawnTracked([
      CHROMIUM!,
      "--headless=new",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      `--user-data-dir=${tmpDir("interlink-chromium-")}`,
      "--remote-debugging-port=0",
      "about:blank",
    ], { stdin: "ignore", stdout: "ignore", stderr: "pipe" });
    const url = await untilLine(c.#proc.stderr, /DevTools listening on (ws:\/\/\S+)/, 30_000);
    c.#ws = new WebSocket(url);
    await new Promise((resolve, reject) => (c.#ws.onopen = resolve, c.#ws.onerror = reject));
    c.#ws.onmessage = (e) => {
      const m = JSON.parse(String(e.data));
      const call = c.#calls.get(m.id);
      if (!call) return; // an event: the tests poll the DOM instead
      c.#calls.delete(m.id);
      if (m.error) call.reject(new Error(`${m.error.message} (${m.error.code})`));
      else call.resolve(m.result);
    };
    const { targetId } = await c.send("Target.createTarget", { url: "about:blank" }, "");
    c.#page = (await c.send("Target.attachToTarget", { targetId, flatten: true }, "")).sessionId;
    return c;
  }

  send(method: string, params: object = {}, session = this.#page): Promise<CdpResult> {
    const id = ++this.#next;
    return new Promise((resolve, reject) => {
      this.#calls.set(id, { resolve, reject });
      this.#ws.send(JSON.stringify({ id, method, params, ...(session ? { sessionId: session } : {}) }));
    });
  }

  /** The value of a JavaScript expression in the page. */
  async eval<T>(expression: string): Promise<T> {
    const r = await this.send("Runtime.evaluate", { expression, returnByValue: true });
    if (r.exceptionDetails) throw new Error(`in the page: ${r.exceptionDetails.exception?.description}`);
    return r.result.value as T;
  }

  /** Loads `url` and waits until its document is complete. */
  async open(url: string): Promise<void> {
    await this.send("Page.navigate", { url });
    await eventually(
      async () => (await this.eval<string>("location.href + ' ' + document.readyState")) === `${url} complete`,
      `the page ${url} loaded`,
    );
  }

  viewport(width: number, height: number): Promise<unknown> {
    return this.send("Emulation.setDeviceMetricsOverride", { width, height, deviceScaleFactor: 1, mobile: false });
  }

  async screenshot(): Promise<Buffer> {
    return Buffer.from((await this.send("Page.captureScreenshot", { format: "png" })).data, "base64");
  }

  close(): void {
    this.#ws?.close();
    if (this.#proc) killGroup(this.#proc.pid);
  }
}

/** `interlink.ts board` as a child for a node's files; resolves with the URL it prints. */
async function startBoardChild(runtime: "bun" | "deno", f: NodeFiles, busUrl: string, stateDir = f.stateDir) {
  const proc = spawnTracked([...runtimeArgv(runtime), "board", "--port", "0"], {
    stdin: "ignore",
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, ...boardEnv(f, busUrl), INTERLINK_STATE: stateDir },
  });
  void untilLine(proc.stderr, /^$^/, 600_000).catch(() => {}); // drained, and shown with INTERLINK_TEST_VERBOSE
  const url = await untilLine(proc.stdout, /^(http:\/\/127\.0\.0\.1:\d+\/\?t=[A-Za-z0-9_-]{43})$/, 30_000);
  return { proc, url };
}

const boardEnv = (f: NodeFiles, busUrl: string): Record<string, string> => ({
  INTERLINK_KEY: f.keyFile,
  INTERLINK_PEERS: f.peersFile,
  INTERLINK_STATE: f.stateDir,
  INTERLINK_URL: busUrl,
});

/** Every file under `dir` with its size and modification time: what a reader must leave as it found it. */
function listing(dir: string): string[] {
  return fs.readdirSync(dir, { recursive: true, withFileTypes: true }).map((e) => {
    const file = path.join(e.parentPath, e.name);
    const st = fs.statSync(file);
    return `${path.relative(dir, file)} ${e.isDirectory() ? "dir" : st.size} ${st.mtimeMs}`;
  }).sort();
}

/** The first snapshot a board's event stream sends, read without a browser. */
async function firstSnapshot(url: string): Promise<BoardView> {
  const r = await fetch(url.replace("/?t=", "/events?t="));
  expect(r.headers.get("content-type")).toBe("text/event-stream; charset=utf-8");
  const reader = r.body!.getReader();
  let text = "";
  for (;;) {
    const { value } = await reader.read();
    text += new TextDecoder().decode(value);
    const m = text.match(/event: snapshot\ndata: (.*)\n\n/);
    if (m) {
      await reader.cancel();
      return JSON.parse(m[1]);
    }
  }
}

describe("the board: malformed requests get a short 4xx, never a runtime's error page", () => {
  test.concurrent(
    "the board answers a Host or target it cannot parse with a short 4xx, under Bun and Deno",
    async () => {
      const { root, A } = await twoPeers();
      const bus = await busOnLoopback(path.join(root, "bus"));
      try {
        for (const runtime of ["bun", "deno"] as const) {
          const board = await startBoardChild(runtime, A, bus.url);
          try {
            const { port, searchParams } = new URL(board.url);
            const token = searchParams.get("t")!;
            // Each with the token: only the Host or the target is wrong. The absolute form (a proxy's, never a
            // browser's) is parsed by Bun, which takes the Host header's authority; Deno takes the target's, and
            // then cannot parse it: either way no error page.
            const cases: [string, string, RegExp][] = [
              [`/?t=${token}`, "[[[", /^4/],
              [`/?t=${token}`, `x@127.0.0.1:${port}`, /^4/],
              [`/?t=${token}`, "127.0.0.1:99999", /^4/],
              [`/?t=${token}`, "", /^4/],
              [`/events?t=${token}`, `127.0.0.1:${port}]`, /^4/],
              [`http://[[[/?t=${token}`, `127.0.0.1:${port}`, /^[24]/],
              [`http://x@127.0.0.1:${port}/?t=${token}`, `127.0.0.1:${port}`, /^[24]/],
            ];
            for (const [target, host, want] of cases) {
              const answer = await rawGet(+port, target, { host });
              const status = answer.split("\r\n")[0].split(" ")[1] ?? "none";
              expect({ runtime, target, host, status: want.test(status) ? "as wanted" : status }).toEqual({
                runtime,
                target,
                host,
                status: "as wanted",
              });
              if (status === "200") continue; // the page itself, to the token's holder
              expect({ runtime, host, leaks: leaks(answer, token), short: answer.length < 600 }).toEqual({
                runtime,
                host,
                leaks: [],
                short: true,
              });
            }
            // And the real thing still works.
            expect((await rawGet(+port, `/?t=${token}`, { host: `127.0.0.1:${port}` })).split("\r\n")[0]).toBe(
              "HTTP/1.1 200 OK",
            );
          } finally {
            killGroup(board.proc.pid, "SIGTERM");
            await board.proc.exited;
          }
        }
      } finally {
        await bus.shutdown();
      }
    },
    90_000,
  );
});

describe("the board: a live page for the operator, read-only, for the token's holder only", () => {
  let root: string, bus: Awaited<ReturnType<typeof busOnLoopback>>;
  let A: NodeFiles, B: NodeFiles;
  let alice: McpNode, bob: McpNode;
  let board: { proc: ReturnType<typeof spawnTracked>; url: string };
  let page: Chromium | null = null;

  beforeAll(async () => {
    ({ root, A, B } = await twoPeers());
    bus = await busOnLoopback(path.join(root, "bus"));
    [alice, bob, board, page] = await Promise.all([
      McpNode.start("bun", A, bus.url),
      McpNode.start("bun", B, bus.url),
      startBoardChild("deno", A, bus.url), // the board under Deno, the demo's under Bun
      CHROMIUM ? Chromium.start() : null,
    ]);
  }, 120_000);

  afterAll(async () => {
    page?.close();
    if (board) killGroup(board.proc.pid, "SIGTERM");
    await Promise.allSettled([alice?.close(), bob?.close(), board?.proc.exited]); // goodbyes on their open tasks
    await bus?.shutdown();
  }, 30_000);

  /** The text of the task card for `task`, or "" while there is none. */
  const card = (task: string) =>
    page!.eval<string>(
      `[...document.querySelectorAll("#tasks .card")].find((c) => c.textContent.includes(${
        JSON.stringify(`task ${task}`)
      }))?.textContent ?? ""`,
    );
  const waiting = () => page!.eval<string>(`document.querySelector("#waiting").textContent`);

  test("a request without the token, from another Host, or from another Origin gets 403 and no data", async () => {
    const { port, searchParams } = new URL(board.url);
    const token = searchParams.get("t")!;
    const ok = await fetch(board.url);
    expect(ok.status).toBe(200);
    // The page runs only its own script: a nonce in the CSP, and nothing cached, sniffed, framed or referred.
    expect(ok.headers.get("content-security-policy")).toMatch(/default-src 'none'; script-src 'nonce-[\w-]+'/);
    expect(ok.headers.get("x-content-type-options")).toBe("nosniff");
    expect(ok.headers.get("referrer-policy")).toBe("no-referrer");
    expect(ok.headers.get("cache-control")).toBe("no-store");
    expect(await ok.text()).not.toContain(token); // the page reads the token from its own URL; it never echoes it
    const refused = [
      await fetch(`http://127.0.0.1:${port}/`),
      await fetch(`http://127.0.0.1:${port}/events`),
      await fetch(`http://127.0.0.1:${port}/events?t=${token.slice(0, -1)}${token.endsWith("A") ? "B" : "A"}`), // one character off
      await fetch(`http://127.0.0.1:${port}/?t=`),
    ];
    for (const r of refused) {
      expect({ status: r.status, body: await r.text() }).toEqual({ status: 403, body: "forbidden\n" });
    }
    // A web page's request (its Origin is its own), sent raw: the exact headers, whatever a fetch adds or drops.
    for (const [target, origin] of [["/", "https://evil.example"], ["/events", `http://127.0.0.1:${+port + 1}`]]) {
      const answer = await rawGet(+port, `${target}?t=${token}`, { host: `127.0.0.1:${port}`, origin });
      expect({ origin, status: answer.split("\r\n")[0] }).toEqual({ origin, status: "HTTP/1.1 403 Forbidden" });
      expect(answer).not.toContain("snapshot");
    }
    // DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 still sends its own Host.
    for (const host of ["evil.example", `evil.example:${port}`, `127.0.0.1:${+port + 1}`]) {
      const answer = await rawGet(+port, `/events?t=${token}`, { host });
      expect({ host, status: answer.split("\r\n")[0] }).toEqual({ host, status: "HTTP/1.1 403 Forbidden" });
      expect(answer).not.toContain("snapshot");
    }
    expect((await rawGet(+port, `/?t=${token}`, { host: `localhost:${port}` })).split("\r\n")[0]).toBe(
      "HTTP/1.1 200 OK",
    );
    // Nothing else is served, even to the token's holder; and it only reads.
    expect((await fetch(board.url.replace("/?t=", "/roster?t="))).status).toBe(404);
    expect((await fetch(board.url, { method: "POST", body: "{}" })).status).toBe(405);
  });

  browserTest(BOARD_BROWSER_TESTS[0], async () => {
    await page!.viewport(1280, 900);
    await page!.open(board.url);
    await eventually(async () => (await page!.eval<string>(`conn.textContent`)).startsWith("live"), "it is connected");
    await page!.eval("window.sameDocument = true"); // gone if anything reloads the page
    const request = await alice.ok("send_message", { to: "bob", text: "install the deps", task_id: "deps" });
    await eventually(async () => (await card("deps")).includes("install the deps"), "the request shows as a row");
    expect(await card("deps")).toMatch(/requested.*with bob.*open.*requested by you · waiting on bob: working on it/);
    await bob.waitEvent((e) => e.meta.msg_id === msgIdOf(request));
    await bob.ok("send_message", { to: "alice", text: "pip install running", task_id: "deps", status: "update" });
    await eventually(async () => (await card("deps")).includes("update pip install running"), "the update shows");
    expect(await waiting()).toContain("nothing waits on you");
    // A question for alice's operator: on the row, and under "waiting on you" with what answers it.
    const question = msgIdOf(
      await bob.ok("send_message", {
        to: "alice",
        text: "Which CUDA version?",
        task_id: "deps",
        status: "needs_input",
      }),
    );
    await eventually(async () => (await waiting()).includes("Which CUDA version?"), "the question waits on you");
    expect(await card("deps")).toContain("waiting on you: bob asked a question");
    expect(await waiting()).toContain(`answer bob's question ${question} on task deps: <your answer>`);
    const command = await page!.eval<string>(`document.querySelectorAll("#waiting pre")[1].textContent`);
    expect(command).toBe(
      `interlink.ts send bob '<your answer>' --task deps --in-reply-to ${question} --session alice --channel bob`,
    );
    // The command it prints is the one that answers: run as printed (with this node's settings in the environment).
    const args = command.replace("'<your answer>'", "12.4").split(" ").slice(1);
    const sent = await runCliAsync("bun", args, { env: boardEnv(A, bus.url) });
    expect({ code: sent.code, stderr: sent.stderr }).toEqual({ code: 0, stderr: "" });
    await eventually(async () => !(await waiting()).includes("Which CUDA version?"), "the answered question leaves");
    expect(await card("deps")).toMatch(/answer 12\.4/);
    const answer = await bob.waitEvent((e) => e.meta.in_reply_to === question);
    expect(answer.content).toBe("[task deps] 12.4");
    await bob.ok("send_message", { to: "alice", text: "done on CUDA 12.4", task_id: "deps", status: "result" });
    await eventually(async () => /^result.*closed/.test(await card("deps")), "the row turns to result, closed");
    expect(await card("deps")).toContain("result done on CUDA 12.4");
    expect(await page!.eval("window.sameDocument")).toBe(true); // all of it live, in one document
  }, 60_000);

  browserTest(BOARD_BROWSER_TESTS[1], async () => {
    const evil = `<script>window.pwned = 1</script><img src=x onerror="window.pwned = 1"></div><b>bold</b>` +
      ` \u202Edetacilpmoc\u202C \u200Bend`;
    await bob.ok("send_message", { to: "alice", text: evil, task_id: "<i>x</i>" });
    await eventually(async () => (await card("<i>x</i>")).includes("bold"), "the hostile message shows");
    const text = await card("<i>x</i>");
    // Shown as the characters they are; bidi and zero-width characters made visible, not obeyed.
    expect(text).toContain(`<script>window.pwned = 1</script><img src=x onerror="window.pwned = 1"></div><b>bold</b>`);
    expect(text).toContain("<U+202E>detacilpmoc<U+202C> <U+200B>end");
    expect(text).not.toMatch(/[\u202a-\u202e\u200b]/);
    // No element was made from it, and no script ran.
    expect(await page!.eval(`document.scripts.length`)).toBe(1);
    expect(await page!.eval(`document.querySelectorAll("img, b, i, main script").length`)).toBe(0);
    expect(await page!.eval(`typeof window.pwned`)).toBe("undefined");
    expect(await page!.eval(`document.querySelectorAll("main > section, main > div").length`)).toBe(3);
  }, 30_000);

  browserTest(BOARD_BROWSER_TESTS[2], async () => {
    await page!.viewport(400, 800);
    try {
      await eventually(async () => (await page!.eval<number>("innerWidth")) === 400, "the window is 400 px wide");
      // The page's width (400 px less a scrollbar, if any): nothing scrolls sideways or sticks out past it.
      const layout = await page!.eval<{ scroll: number; width: number; columns: string; wide: string[] }>(`({
        scroll: document.documentElement.scrollWidth,
        width: document.documentElement.clientWidth,
        columns: getComputedStyle(document.querySelector("main")).gridTemplateColumns,
        wide: [...document.querySelectorAll("body *")]
          .filter((e) => e.getBoundingClientRect().right > document.documentElement.clientWidth + 0.5)
          .map((e) => e.tagName + "." + e.className + ": " + e.textContent.slice(0, 40)),
      })`);
      expect(layout.width).toBeGreaterThan(360);
      expect(layout).toEqual({
        scroll: layout.width,
        width: layout.width,
        columns: `${layout.width - 16}px`,
        wide: [],
      });
    } finally {
      await page!.viewport(1280, 900);
    }
  }, 30_000);

  test("the board takes no lock and writes nothing in the state folder", async () => {
    await alice.ok("send_message", { to: "bob", text: "a task to show", task_id: "still" });
    const copy = path.join(tmpDir(), "state");
    fs.cpSync(A.stateDir, copy, { recursive: true }); // a still copy: the live agent keeps writing to its own
    const before = listing(copy);
    const reader = await startBoardChild("bun", A, bus.url, copy);
    try {
      const view = await firstSnapshot(reader.url);
      expect(view.tasks.map((t) => t.task_id)).toContain("still");
      await fetch(reader.url).then((r) => r.text());
      if (page) {
        await page.open(reader.url);
        await eventually(async () => (await card("still")).includes("a task to show"), "the copy's board shows it");
      }
    } finally {
      killGroup(reader.proc.pid, "SIGTERM");
      expect(await reader.proc.exited).toBe(0);
    }
    expect(listing(copy)).toEqual(before);
  }, 30_000);

  test("a board left open stays bounded: 2,000 tasks and floods of receipts and refusals fold into capped lists", () => {
    const dir = tmpDir();
    const fold = new BoardFold(dir, A.id.publicKey, () => 1e12);
    const msg = (i: number, j: number, extra: Partial<SignedMessage> = {}): SignedMessage => ({
      from: B.id.publicKey,
      to: A.id.publicKey,
      text: `${i}.${j} ` + "x".repeat(10_000),
      ts: 1e12,
      msg_id: `m${i}-${j}`,
      kind: "message",
      task_id: `t${i}`,
      sig: b64urlEncode(new Uint8Array(64)), // never checked: the journal holds what the gate admitted
      ...extra,
    });
    for (let i = 0; i < 2000; i++) {
      // alice asks, bob answers: every even task ends on a question for alice's operator
      const request = msg(i, 0, { from: A.id.publicKey, to: B.id.publicKey });
      fold.apply("s1", { t: "out", at: i * 100, peer: "bob", recipient: B.id.publicKey, msg: request });
      for (let j = 1; j < (i % 100 === 0 ? 30 : 2); j++) {
        const status = i % 2 ? "update" : "needs_input";
        fold.apply("s1", { t: "in", at: i * 100 + j, peer: "bob", msg: msg(i, j, { status }) });
      }
    }
    for (let i = 0; i < 500; i++) {
      fold.apply("s1", { t: "refusal", at: i, key: eve.publicKey, reason: "not_allowlisted", detail: "x".repeat(999) });
      const report = msg(i, 0, { kind: "receipt", text: `delivered o${i} 1 b`, task_id: undefined });
      fold.apply("s1", { t: "receipt", at: i, peer: "bob", msg: report });
      fold.apply("s1", { t: "knock", at: 1e12, key: `k${i}`, name: "x".repeat(64), msg_id: `k${i}`, ts: 1 });
    }
    const peers = parsePeers(JSON.stringify({ bob: { key: B.id.publicKey } }));
    const view = boardView(fold, { now: 1e12, peers, roster: [], problems: [], relays: [] });
    expect(view.totals.tasks).toBe(2000);
    expect(view.tasks.length).toBe(BOARD_TASKS_MAX);
    expect(view.tasks[0].task_id).toBe("t1999"); // newest activity first
    expect(fold.timelines.size).toBe(BOARD_TIMELINES_CAP); // the quietest tasks' timelines went first
    for (const t of view.tasks) {
      expect(t.timeline.length).toBeLessThanOrEqual(BOARD_TIMELINE_MAX);
      for (const i of t.timeline) expect(i.text.length).toBeLessThanOrEqual(BOARD_TEXT_MAX + 1);
    }
    const long = view.tasks.find((t) => t.task_id === "t1900")!;
    expect(long.timeline.map((i) => i.msg_id)).toEqual([
      "m1900-0",
      ...[23, 24, 25, 26, 27, 28, 29].map((j) => `m1900-${j}`),
    ]);
    expect(long.elided).toBe(22); // the request, "… 22 more", then the newest
    expect(view.delivery.refusals.length).toBe(BOARD_LIST_MAX);
    expect(view.delivery.receipts.length).toBe(BOARD_LIST_MAX);
    expect(view.delivery.by_reason).toEqual([{ reason: "in not_allowlisted", count: 500 }]);
    expect(view.waiting.length).toBe(BOARD_LIST_MAX); // questions and knocks together
    expect(view.totals.waiting).toBe(980 + 20 * 29 + 64); // a question on each even task (29 on the long ones); knocks
    expect(JSON.stringify(view).length).toBeLessThan(1_000_000); // one snapshot stays well under a megabyte
  });

  test("serve's executors are listed (peer, task, host, pid, folder, started, turns, cost, denials): bounded, their text shown as text, a bad row harmless", () => {
    const fold = new BoardFold(tmpDir(), B.id.publicKey, () => 1e12);
    const row = {
      peer: "ali\u202Ece",
      task: "t1",
      host: "claude",
      state: "running",
      pid: 4242,
      cwd: "/w",
      started: 5,
      turns: 3,
      cost: 0.25,
      denials: ["Write: /w/x"],
    };
    const executors = [row, 7, null, ...Array.from({ length: 99 }, () => row)];
    const ctx = { now: 1e12, peers: parsePeers("{}"), roster: [], problems: [], relays: [], executors };
    const view = boardView(fold, ctx);
    expect(view.executors.length).toBe(BOARD_LIST_MAX);
    expect(view.executors[0]).toEqual({ ...row, peer: "ali<U+202E>ce" });
    expect(view.executors[1]).toMatchObject({ peer: "", pid: null, denials: [] });
    expect(boardView(fold, { ...ctx, executors: { not: "a list" } }).executors).toEqual([]);
  });

  test("a sub-task's question forwarded up the chain waits on its owner's human, not on the middle node's", () => {
    // B's board: A asked B for "site", B handed "logo" to eve as a sub-task of it, eve asked, B's node forwarded.
    const fold = new BoardFold(tmpDir(), B.id.publicKey, () => 1e12);
    const msg = (from: string, to: string, f: Partial<SignedMessage>): SignedMessage => ({
      from,
      to,
      text: "x",
      ts: 1e12,
      msg_id: f.msg_id ?? "m",
      kind: "message",
      sig: b64urlEncode(new Uint8Array(64)), // never checked: the journal holds what the gate admitted
      ...f,
    });
    const chain: Chain = {
      parent: "site",
      requester: A.id.publicKey,
      owner: A.id.publicKey,
      depth: 2,
      keys: [A.id.publicKey, B.id.publicKey],
      sig: b64urlEncode(new Uint8Array(64)),
    };
    const a = A.id.publicKey, b = B.id.publicKey, e = eve.publicKey;
    fold.apply("s1", { t: "in", at: 1, peer: "alice", msg: msg(a, b, { msg_id: "r", task_id: "site" }) });
    fold.apply("s1", {
      t: "out",
      at: 2,
      peer: "eve",
      recipient: e,
      msg: msg(b, e, { msg_id: "s", task_id: "logo" }),
      chain,
    });
    const q = msg(e, b, { msg_id: "q", task_id: "logo", status: "needs_input", text: "which sizes?" });
    fold.apply("s1", { t: "in", at: 3, peer: "eve", msg: q, relay: { dir: "up", to: a, task_id: "site" } });
    const f = msg(b, a, {
      msg_id: "f",
      task_id: "site",
      status: "needs_input",
      text: "eve asks, via bob: which sizes?",
    });
    const forward = { peer: e, task_id: "logo", question: "q" };
    fold.apply("s1", { t: "out", at: 4, peer: "alice", recipient: a, msg: f, forward });
    const peers = parsePeers(JSON.stringify({ alice: { key: a }, eve: { key: e } }));
    const view = boardView(fold, { now: 1e12, peers, roster: [], problems: [], relays: [] });
    expect(view.waiting).toEqual([]); // not B's operator's to answer
    const logo = view.tasks.find((t) => t.task_id === "logo")!;
    expect(logo.parent).toEqual({ task_id: "site", requester: "alice", owner: "alice", word: null }); // B's own
    expect(logo.blocked_on).toEqual({ who: "alice", why: "eve's question, forwarded to alice" });
    expect(view.tasks.find((t) => t.task_id === "site")!.blocked_on).toEqual({
      who: "alice",
      why: "your question waits for their answer",
    });
    // A's board: the forwarded question waits on A's operator, who owns the work.
    const theirs = new BoardFold(tmpDir(), a, () => 1e12);
    theirs.apply("s1", {
      t: "out",
      at: 1,
      peer: "bob",
      recipient: b,
      msg: msg(a, b, { msg_id: "r", task_id: "site" }),
    });
    theirs.apply("s1", { t: "in", at: 4, peer: "bob", msg: f });
    const asks = boardView(theirs, {
      now: 1e12,
      peers: parsePeers(JSON.stringify({ bob: { key: b } })),
      roster: [],
      problems: [],
      relays: [],
    }).waiting;
    expect(asks).toMatchObject([{
      kind: "question",
      peer: "bob",
      msg_id: "f",
      owner: "you",
      text: "eve asks, via bob: which sizes?",
    }]);
  });

  test("on a sub-task's executor's board, which task of whom it serves and whose work it is are its requester's word", () => {
    // eve's board: bob asked eve for "logo", saying (his signed chain) it serves alice's task "site", for alice.
    const a = A.id.publicKey, b = B.id.publicKey, e = eve.publicKey;
    const fold = new BoardFold(tmpDir(), e, () => 1e12);
    const sig = b64urlEncode(new Uint8Array(64)); // never checked: the journal holds what the gate admitted
    const chain: Chain = { parent: "site", requester: a, owner: a, depth: 2, keys: [a, b], sig };
    const ask = { from: b, to: e, text: "draw it", ts: 1e12, msg_id: "s", kind: "message" as const, task_id: "logo" };
    fold.apply("s1", { t: "in", at: 1, peer: "bob", msg: { ...ask, sig }, chain });
    const q = { ...ask, from: e, to: b, msg_id: "q", status: "needs_input" as const, text: "which sizes?", sig };
    fold.apply("s1", { t: "out", at: 2, peer: "bob", recipient: b, msg: q });
    const peers = parsePeers(JSON.stringify({ alice: { key: a }, bob: { key: b } }));
    const logo = boardView(fold, { now: 1e12, peers, roster: [], problems: [], relays: [] }).tasks[0];
    expect(logo.parent).toEqual({ task_id: "site", requester: "alice", owner: "alice", word: "bob" });
  });

  test("the fold reads only what a journal gained, and lists a moved session's task once, where it went", () => {
    const dir = tmpDir();
    const fold = new BoardFold(dir, A.id.publicKey, () => 1e12);
    const msg = (id: string, status?: TaskStatus): SignedMessage => ({
      from: B.id.publicKey,
      to: A.id.publicKey,
      text: id,
      ts: 1e12,
      msg_id: id,
      kind: "message",
      task_id: "t",
      sig: b64urlEncode(new Uint8Array(64)), // never checked: the journal holds what the gate admitted
      ...(status ? { status } : {}),
    });
    const journal = (session: string) => path.join(dir, "sessions", session, "log.jsonl");
    const write = (session: string, records: JournalRecord[]) => {
      fs.mkdirSync(path.dirname(journal(session)), { recursive: true });
      fs.appendFileSync(journal(session), records.map(encodeRecord).join("\n") + "\n");
    };
    const lines = Array.from({ length: 1000 }, (_, i): JournalRecord => ({
      t: "in",
      at: i,
      peer: "bob",
      msg: msg(`m${i}`, "update"),
    }));
    write("old", lines);
    expect(fold.catchUp()).toBe(true);
    expect(fold.records).toBe(1000);
    expect(fold.catchUp()).toBe(false); // nothing new: nothing read
    expect(fold.records).toBe(1000);
    // The session ends and another adopts it: the task is listed once, in the new session, with its whole story.
    const carried = fold.sessions.get("old")!.state.carry(2000, { session: "old", at: 2000 });
    write("new", [{ t: "adopted", at: 2000, session: "old", carried }, {
      t: "in",
      at: 2001,
      peer: "bob",
      msg: msg("n1"),
    }]);
    write("old", [{ t: "moved", at: 2000, to: "new" }]);
    expect(fold.catchUp()).toBe(true);
    expect(fold.records).toBe(1003);
    const peers = parsePeers(JSON.stringify({ bob: { key: B.id.publicKey } }));
    const view = boardView(fold, { now: 1e12, peers, roster: [], problems: [], relays: [] });
    expect(view.tasks.map((t) => [t.session, t.task_id])).toEqual([["new", "t"]]);
    expect(view.tasks[0].timeline.map((i) => i.msg_id)).toEqual([
      "m0",
      "m994",
      "m995",
      "m996",
      "m997",
      "m998",
      "m999",
      "n1",
    ]);
    expect(view.sessions.find((s) => s.session === "old")?.note).toBe("ended; session new took over its work");
    // The new session's journal rolls over (see Journal.roll) and goes on: the archive is read on where the fold
    // left it, the new log.jsonl from its checkpoint, and the timeline gains only what is new; a board opened
    // afterwards reads the archives and shows the same.
    write("new", Array.from({ length: 15_000 }, (_, i) => ({ t: "sent", at: 2002, msg_id: `pad${i}`, via: [] })));
    expect(fold.catchUp()).toBe(true);
    const owner = new Journal(path.join(dir, "sessions", "new"), new NodeState(() => 1e12), true, () => 1e12);
    expect(owner.roll()).toBe(true);
    owner.close();
    write("new", [{ t: "in", at: 2003, peer: "bob", msg: msg("n2") }]);
    const folded = fold.records;
    expect(fold.catchUp()).toBe(true);
    // The checkpoint, a record for each message it carries (n1, unread), and n2.
    expect(fold.records).toBe(folded + readJsonl(path.join(dir, "sessions", "new", "log.jsonl")).length);
    expect(readJsonl(path.join(dir, "sessions", "new", "log.jsonl")).map((r) => r.t)).toEqual([
      "checkpoint",
      "carried",
      "in",
    ]);
    const timeline = (f: BoardFold) =>
      boardView(f, { now: 1e12, peers, roster: [], problems: [], relays: [] }).tasks[0].timeline.map((i) => i.msg_id);
    expect(timeline(fold)).toEqual(["m0", "m995", "m996", "m997", "m998", "m999", "n1", "n2"]);
    const fresh = new BoardFold(dir, A.id.publicKey, () => 1e12);
    fresh.catchUp();
    expect(timeline(fresh)).toEqual(timeline(fold));
  });

  browserTest(BOARD_BROWSER_TESTS[3], async () => {
    const demo = spawnTracked([process.execPath, SCRIPT, "demo", "--board"], {
      stdin: "ignore",
      stdout: "pipe",
      stderr: "pipe",
      env: { ...process.env },
    });
    void untilLine(demo.stderr, /^$^/, 600_000).catch(() => {});
    const url = await untilLine(demo.stdout, /board +alice's board: (http:\/\/127\.0\.0\.1:\d+\/\?t=\S+)$/, 60_000);
    await page!.viewport(1280, 900);
    await page!.open(url);
    await eventually(async () => (await waiting()).includes("1080p or 4K for the final cut?"), "the demo's question");
    await eventually(async () => (await card("deps")).includes("Done: ComfyUI is up on CUDA 12.4"), "the demo's tasks");
    const receipts = () => page!.eval<string>(`document.querySelector("#delivery").textContent`);
    await eventually(async () => (await receipts()).includes("shown to their model"), "bob's receipts");
    const height = await page!.eval<number>("document.documentElement.scrollHeight");
    await page!.viewport(1280, Math.min(height, 3000));
    const shot = path.join(
      process.env.INTERLINK_TEST_VERBOSE ? fs.mkdtempSync(path.join(os.tmpdir(), "interlink-board-")) : tmpDir(),
      "board-demo.png",
    );
    fs.writeFileSync(shot, await page!.screenshot());
    expect(fs.readFileSync(shot).subarray(0, 8)).toEqual(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]));
    if (process.env.INTERLINK_TEST_VERBOSE) process.stderr.write(`  the board during the demo: ${shot}\n`);
    // It stays up until Ctrl-C, then cleans up and exits 0.
    expect(demo.exitCode).toBeNull();
    killGroup(demo.pid, "SIGINT");
    expect(await demo.exited).toBe(0);
    expect((await fetch(url).catch(() => null))?.status).toBeUndefined();
  }, 90_000);
});
