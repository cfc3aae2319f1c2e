// Tests for dev/demo.ts, `interlink.ts demo` (the README's first command): a clone runs it under Bun and under Deno
// and shows every step of the lifecycle. The core's tests are interlink.test.ts; the helpers they share,
// dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import * as fs from "node:fs";
import * as path from "node:path";
import { cloneLike, denoPath, made, spawnAsync, sweepAfterAll } from "./testkit.ts";

sweepAfterAll();

describe("the demo (dev/demo.ts): a clone runs it under Bun and Deno", () => {
  const LIFECYCLE_STEPS = [
    /alice discover → .* claims "bob"/,
    /alice request_pair → asked/,
    /bob {3}channel event: Not a peer: a node with fingerprint \S+, which claims the name "alice" \(unverified\), asks to pair/,
    /bob {3}\(the operator decides\) accept_pair → paired: 'alice'/,
    /alice channel event: Pairing complete/,
    /bob {3}← alice: \[task deps\] Install the deps/,
    /alice ← bob: \[task deps · update\]/,
    /alice ← bob: \[task deps · needs_input\] Which CUDA version\?/,
    /bob {3}← alice: \[task deps\] 12\.4 +\(in_reply_to [0-9a-f]{32}\)/,
    /alice ← bob: \[task deps · result\]/,
    /bob {3}← alice: \[task bench · canceled\]/,
    /refused: task "bench" is closed/,
    /task deps with bob( \(session \S+\))?; requested by you; status result; closed/,
    /signed with mallory's key → the bus answers 400 .*signature does not verify/,
    /gate: refused a message from .*not_allowlisted/,
    /notice for the operator: 1 message from an unknown key \S+ was refused: not in your peers/,
    /the forgery was refused by the bus, the stranger by bob's gate/,
  ];

  test.concurrent(
    "a clone without node_modules runs the demo under Bun (auto-installing the SDK client) and shows every step",
    async () => {
      const copy = cloneLike("interlink-demo-copy-");
      const r = await spawnAsync(process.execPath, [path.join(copy, "interlink.ts"), "demo"], {
        cwd: copy,
        timeout: 60_000,
        env: { ...process.env },
      });
      expect({ code: r.status, stderr: r.status === 0 ? "" : r.stderr }).toEqual({ code: 0, stderr: "" });
      for (const step of LIFECYCLE_STEPS) expect(r.stdout).toMatch(step);
      const folder = r.stdout.match(/temporary folders under (\S+)/)![1];
      expect(fs.existsSync(folder)).toBe(false); // cleaned up
    },
    60_000,
  );

  test.concurrent(
    "a clone under Deno, with no deno.json, runs the demo; --keep leaves its folders",
    async () => {
      const copy = cloneLike("interlink-deno-copy-");
      const r = await spawnAsync(denoPath(), [
        "run",
        "-A",
        "--quiet",
        path.join(copy, "interlink.ts"),
        "demo",
        "--keep",
      ], {
        cwd: copy,
        timeout: 120_000,
      });
      expect({ code: r.status, stderr: r.status === 0 ? "" : r.stderr }).toEqual({ code: 0, stderr: "" });
      for (const step of LIFECYCLE_STEPS) expect(r.stdout).toMatch(step);
      const kept = r.stdout.match(/kept (\S+)/)![1];
      made.dirs.add(kept); // removed by the final sweep
      expect(fs.existsSync(path.join(kept, "alice", "state", "sessions", "alice", "log.jsonl"))).toBe(true);
    },
    120_000,
  );
});
