// Tests for extras/codex.ts, `interlink.ts codex-install`: interlink into Codex CLI's config, read back by the real
// Codex CLI (pinned, a dev dependency). Codex sessions as peers (the core's Codex host support) are tested with the
// core, in interlink.test.ts; the helpers they share are dev/testkit.ts.

import { describe, expect } from "bun:test";
import * as fs from "node:fs";
import * as path from "node:path";
import { CODEX_BIN, codexTest, runCliAsync, sweepAfterAll, tmpDir } from "../dev/testkit.ts";

sweepAfterAll();

describe("Codex CLI sessions as peers", () => {
  codexTest(
    "codex-install writes its block, hook and trust beside what is there, Codex reads the hook as trusted; again changes nothing; --remove restores",
    async () => {
      const home = tmpDir("interlink-codex-home-");
      const config = [
        'model = "gpt-5"',
        "",
        "[mcp_servers.docs]",
        'command = "docs-server"',
        "",
        "[profiles.fast]",
        'model = "small"',
        "",
      ].join("\n");
      const hooks = JSON.stringify(
        {
          hooks: {
            SessionStart: [{ hooks: [{ type: "command", command: "echo hi" }] }],
            Stop: [{ hooks: [{ type: "command", command: "true" }] }],
          },
        },
        null,
        2,
      );
      fs.writeFileSync(path.join(home, "config.toml"), config);
      fs.writeFileSync(path.join(home, "hooks.json"), hooks);
      const install = (...extra: string[]) =>
        runCliAsync("bun", ["codex-install", "--codex-home", home, "--codex-bin", CODEX_BIN!, ...extra], {
          env: { INTERLINK_URL: "http://10.0.0.5:9440" },
        });
      const first = await install();
      expect(first.stderr).toBe("");
      expect(first.stdout).toContain("the hook is trusted");
      const toml = fs.readFileSync(path.join(home, "config.toml"), "utf8");
      expect(toml.startsWith(config)).toBe(true); // what was there is untouched, byte for byte
      expect(toml).toContain("[mcp_servers.interlink]");
      expect(toml).toContain('INTERLINK_URL = "http://10.0.0.5:9440"');
      expect(toml).toContain('INTERLINK_HOST = "codex"');
      expect(toml).toMatch(/\[mcp_servers\.interlink\.tools\.accept_pair\]\napproval_mode = "prompt"/);
      const written = JSON.parse(fs.readFileSync(path.join(home, "hooks.json"), "utf8"));
      expect(written.hooks.Stop).toEqual(JSON.parse(hooks).hooks.Stop);
      expect(written.hooks.SessionStart).toEqual([
        { hooks: [{ type: "command", command: "echo hi" }] },
        {
          hooks: [{ type: "mcp_tool", server: "interlink", tool: "bind_session", input: { session: "${session_id}" } }],
        },
      ]);
      expect(toml).toContain(`[hooks.state."${fs.realpathSync(path.join(home, "hooks.json"))}:session_start:1:0"]`);
      // Again: the same files.
      await install();
      expect(fs.readFileSync(path.join(home, "config.toml"), "utf8")).toBe(toml);
      // A server named interlink that the user wrote is never overwritten.
      const mine = tmpDir("interlink-codex-home-");
      fs.writeFileSync(path.join(mine, "config.toml"), '[mcp_servers.interlink]\ncommand = "mine"\n');
      const refused = await runCliAsync("bun", ["codex-install", "--codex-home", mine]);
      expect(refused.code).toBe(1);
      expect(refused.stderr).toContain(
        "already configures an MCP server named interlink that codex-install did not write",
      );
      expect(fs.readFileSync(path.join(mine, "config.toml"), "utf8")).toBe(
        '[mcp_servers.interlink]\ncommand = "mine"\n',
      );
      // --remove takes out exactly what it put in.
      await install("--remove");
      expect(fs.readFileSync(path.join(home, "config.toml"), "utf8")).toBe(config);
      expect(JSON.parse(fs.readFileSync(path.join(home, "hooks.json"), "utf8"))).toEqual(JSON.parse(hooks));
    },
    60_000,
  );
});
