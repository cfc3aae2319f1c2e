/**
 * extras/verify.ts: `interlink.ts verify`, for people writing or auditing
 * another node: checks signed messages, bus answers and announcements read
 * from stdin, one JSON object per line, with the core's own strict checks.
 */

import {
  type CommandSpec,
  EXTRAS,
  isObject,
  parseAnnouncement,
  parseSignedMessage,
  print,
  readStdin,
  runExtra,
  verifyAnnouncement,
  verifyMessage,
} from "../interlink.ts";

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

async function runVerify(): Promise<number> {
  const lines = readStdin().split("\n");
  if (lines.at(-1) === "") lines.pop();
  let allOk = lines.length > 0;
  for (const line of lines) {
    const verdict = line.trim() === "" ? "invalid: empty line" : await verifyLine(line);
    if (!verdict.startsWith("ok ")) allOk = false;
    print(verdict);
  }
  return allOk ? 0 : 1;
}

export const command: CommandSpec = {
  summary: EXTRAS["verify"].summary,
  about: "Prints one line per input line: `ok <sender key>` or `invalid: <reason>`. Accepts signed\n" +
    "messages, bus recv answers (the envelope's payload is checked) and announcements.\n" +
    "Exits 0 only if every line was ok.",
  options: {},
  run: runVerify,
};

if (import.meta.main) runExtra("verify", command);
