// Tests for dev/bench.ts, the benchmark: what it says it measures, and what it refuses before it runs anything.
// The core's tests are interlink.test.ts; the helpers they share, dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import * as path from "node:path";
import { OPTIONS as BENCH_OPTIONS, PARTS as BENCH_PARTS } from "./bench.ts";
import { REPO, spawnAsync, sweepAfterAll } from "./testkit.ts";

sweepAfterAll();

describe("the benchmark (dev/bench.ts): its help and its parts", () => {
  test.concurrent(
    "bench.ts --help describes every part and flag; an unknown part is refused by name before anything runs",
    async () => {
      const bench = path.join(REPO, "dev", "bench.ts");
      const [help, unknown] = await Promise.all([
        spawnAsync(process.execPath, [bench, "--help"], { timeout: 10_000 }),
        spawnAsync(process.execPath, [bench, "--only", "idle,nope"], { timeout: 10_000 }),
      ]);
      expect({ code: help.status, stderr: help.stderr }).toEqual({ code: 0, stderr: "" });
      expect(help.stdout).toContain("Usage: bun dev/bench.ts");
      for (const part of BENCH_PARTS) expect(help.stdout).toContain(`${part}:`); // each part says what it measures
      for (const flag of Object.keys(BENCH_OPTIONS)) expect(help.stdout).toContain(`--${flag}`);
      expect(unknown.status).toBe(1);
      expect(unknown.stderr).toBe(`bench: unknown benchmark 'nope'; choose from ${BENCH_PARTS.join(", ")}\n`);
      expect(unknown.stdout).toBe(""); // no report: idle did not run
    },
    10_000,
  );
});
