// Tests for dev/harness.ts, the MCP client harness that the demo, the tests and the benchmark drive: its SDK pins.
// The core's tests are interlink.test.ts; the helpers they share, dev/testkit.ts.

import { describe, expect, test } from "bun:test";
import * as fs from "node:fs";
import * as path from "node:path";
import { SDK, ZOD } from "./harness.ts";
import { REPO, sweepAfterAll } from "./testkit.ts";

sweepAfterAll();

describe("the MCP client harness (dev/harness.ts)", () => {
  const json = (f: string) => JSON.parse(fs.readFileSync(path.join(REPO, f), "utf8"));

  test("the SDK and zod are pinned in one place, the harness (dev/harness.ts): package.json and bun.lock follow it", () => {
    const pkg = json("package.json");
    expect(pkg.dependencies[SDK.name]).toBe(SDK.version);
    expect(pkg.dependencies[ZOD.name]).toBe(ZOD.version);
    const lock = fs.readFileSync(path.join(REPO, "bun.lock"), "utf8");
    expect(lock).toContain(`"${SDK.name}@${SDK.version}"`);
    expect(lock).toContain(`"${ZOD.name}@${ZOD.version}"`);
    expect(
      fs.readFileSync(path.join(REPO, "dev", "harness.ts"), "utf8").match(
        /@modelcontextprotocol\/sdk@(\d+\.\d+\.\d+)/g,
      )!.every((m) => m.endsWith(SDK.version)),
    )
      .toBe(true);
  });
});
