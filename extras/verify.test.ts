// Tests for extras/verify.ts, `interlink.ts verify`: the signing vectors of the independent implementation, each given
// its verdict under Bun and Deno. The core's tests are interlink.test.ts; the helpers they share, dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import { runCli, sweepAfterAll, VECTORS } from "../dev/testkit.ts";

sweepAfterAll();

describe("verify: the signing vectors from the independent implementation", () => {
  test("every vector gets the right verdict from `interlink.ts verify` under Bun and Deno", () => {
    const valid = [...VECTORS.valid.map((c: { message: unknown }) => c.message), VECTORS.announce[0]];
    const invalid = VECTORS.invalid.map((c: { message: unknown }) => c.message);
    const lines = (xs: unknown[]) => xs.map((x) => JSON.stringify(x)).join("\n") + "\n";
    for (const rt of ["bun", "deno"] as const) {
      const ok = runCli(rt, ["verify"], { input: lines(valid) });
      expect({ rt, code: ok.code, stderr: ok.stderr }).toEqual({ rt, code: 0, stderr: "" });
      expect(ok.stdout.trim().split("\n")).toEqual(
        valid.map((m: { from?: string; pubkey?: string }) => `ok ${m.from ?? m.pubkey}`),
      );
      const bad = runCli(rt, ["verify"], { input: lines(invalid) });
      expect(bad.code).toBe(1);
      const out = bad.stdout.trim().split("\n");
      expect(out.length).toBe(invalid.length);
      for (const line of out) expect(line).toStartWith("invalid: ");
      // One bad line among good ones still fails the run, and costs no other line.
      const mixed = runCli(rt, ["verify"], { input: lines([valid[0], invalid[0], valid[1]]) });
      expect(mixed.code).toBe(1);
      expect(mixed.stdout.trim().split("\n").map((l) => l.split(" ")[0])).toEqual(["ok", "invalid:", "ok"]);
    }
  }, 120_000);
});
