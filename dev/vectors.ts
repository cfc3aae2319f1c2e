/**
 * dev/vectors.ts: writes vectors/chain-v1.json, the test vectors of the chain a
 * sub-task's request carries beside the signed fields (docs/wire.md, "Delegation
 * across hops"). Keys come from fixed seeds (alice's and bob's are those of
 * vectors/v2.json) and Ed25519 is deterministic, so the file is the same on
 * every run; a test holds the file to what this makes and checks every vector.
 * Run it as `bun dev/vectors.ts` after changing the chain's bytes (and say so in
 * docs/wire.md: other implementations check against the file).
 */

import * as fs from "node:fs";
import * as path from "node:path";
import { fileURLToPath } from "node:url";
import {
  b64urlDecode,
  type Chain,
  CHAIN_DOMAIN,
  chainBytes,
  type Identity,
  identityFromSeed,
  signChain,
  type SignedMessage,
  signMessage,
} from "../interlink.ts";

/** Fixed seeds (base64url): alice and bob as in vectors/v2.json; carol and dave made once for these vectors. */
export const CHAIN_VECTOR_SEEDS = {
  alice: "2GIuSdsVyrRtBEyO1oe9JngMarfFodmuLdeXV4qgYHU",
  bob: "nGSl6oBLkZlvvP7SSNuo1-hsZkzR9NofUBndGfinBOQ",
  carol: "nY5f69w09IvUCOYHjg8uPW3bvhHs1YQOiMZ9alYbkj8",
  dave: "farU63e740PcAA0KOyGn4XunOtGtz7LzldQL9xe94mg",
} as const;

type Who = keyof typeof CHAIN_VECTOR_SEEDS;

const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");

/** The vectors as the file holds them. */
export async function chainVectors(): Promise<object> {
  const ids = {} as Record<Who, Identity>;
  for (const who of Object.keys(CHAIN_VECTOR_SEEDS) as Who[]) {
    ids[who] = await identityFromSeed(b64urlDecode(CHAIN_VECTOR_SEEDS[who], 32, "seed"));
  }
  const { alice, bob, carol, dave } = ids;
  const T0 = 1767225600000;
  const message = (from: Identity, to: Identity, fields: Partial<SignedMessage>, ts: number) =>
    signMessage(from, { to: to.publicKey, text: "", ...fields }, ts);
  const payload = (msg: SignedMessage, chain: Chain) => ({ ...msg, reply_to: `${msg.from}#s1`, chain });

  // alice asked bob for task "site" (a root task, no chain); bob hands part of it to carol, carol part of that to dave.
  const toCarol = await message(bob, carol, {
    text: "render the logo in three sizes",
    msg_id: "c0ffee0000000000000000000000b0b1",
    task_id: "logo",
  }, T0);
  const chain2 = await signChain(bob, toCarol, {
    parent: "site",
    requester: alice.publicKey,
    owner: alice.publicKey,
    depth: 2,
    keys: [alice.publicKey, bob.publicKey],
  });
  const toDave = await message(carol, dave, {
    text: "vectorise the sketch",
    msg_id: "c0ffee00000000000000000000ca7011",
    task_id: "logo-svg",
  }, T0 + 1000);
  const chain3 = await signChain(carol, toDave, {
    parent: "logo",
    requester: bob.publicKey,
    owner: alice.publicKey,
    depth: 3,
    keys: [alice.publicKey, bob.publicKey, carol.publicKey],
  });
  const valid = [
    { name: "bob hands part of alice's task to carol (depth 2)", msg: toCarol, chain: chain2 },
    { name: "carol hands part of bob's sub-task to dave (depth 3)", msg: toDave, chain: chain3 },
  ].map(({ name, msg, chain }) => ({
    name,
    payload: payload(msg, chain),
    canonical_hex: hex(chainBytes({ ...msg, task_id: msg.task_id! }, chain)),
  }));

  // Each invalid one is a valid message (its v2 signature verifies) whose chain must not count.
  const other = await message(bob, carol, {
    text: "and the favicon",
    msg_id: "c0ffee0000000000000000000000b0b2",
    task_id: "favicon",
  }, T0 + 2000);
  const toDaveFromBob = await message(bob, dave, { text: toCarol.text, msg_id: toCarol.msg_id, task_id: "logo" }, T0);
  const update = await message(bob, carol, {
    text: "half done",
    msg_id: "c0ffee0000000000000000000000b0b3",
    task_id: "logo",
    status: "update",
  }, T0 + 3000);
  const { sig: _sig, ...fields2 } = chain2;
  const resigned = async (by: Identity, msg: SignedMessage, c: Omit<Chain, "sig">) => await signChain(by, msg, c);
  const invalid = [
    {
      name: "lifted onto another message of the sender",
      why: "msg_id and task_id are signed",
      msg: other,
      chain: chain2,
    },
    { name: "re-addressed to another recipient", why: "to is signed", msg: toDaveFromBob, chain: chain2 },
    {
      name: "signed by the owner, not the sender",
      why: "the sender signs",
      msg: toCarol,
      chain: await resigned(alice, toCarol, fields2),
    },
    {
      name: "a lineage rewritten by a relay (another owner)",
      why: "owner, requester and keys are signed",
      msg: toCarol,
      chain: { ...chain2, keys: [dave.publicKey, bob.publicKey], owner: dave.publicKey, requester: dave.publicKey },
    },
    {
      name: "its last key is not the sender",
      why: "keys end with the sender",
      msg: toCarol,
      chain: await resigned(bob, toCarol, { ...fields2, keys: [alice.publicKey, dave.publicKey] }),
    },
    {
      name: "a key twice",
      why: "a chain holds each key once",
      msg: toCarol,
      chain: await resigned(bob, toCarol, {
        ...fields2,
        depth: 3,
        keys: [alice.publicKey, alice.publicKey, bob.publicKey],
        requester: alice.publicKey,
      }),
    },
    {
      name: "depth is not the number of keys",
      why: "depth = keys",
      msg: toCarol,
      chain: await resigned(bob, toCarol, { ...fields2, depth: 3 }),
    },
    {
      name: "on a message that opens no task (an update)",
      why: "only a request carries one",
      msg: update,
      chain: chain2,
    },
  ].map(({ name, why, msg, chain }) => ({ name, why, payload: payload(msg, chain) }));

  return {
    about:
      "interlink chain-v1 vectors: the chain a sub-task's request carries beside the v2 fields (docs/wire.md). Keys derive from the seeds (alice and bob as in v2.json). Each payload's v2 signature verifies (a reference node reads it as an ordinary message); 'valid' chains verify and reproduce canonical_hex and sig; 'invalid' ones must not count (the message is then a root task).",
    domain: CHAIN_DOMAIN,
    keys: Object.fromEntries(
      (Object.keys(ids) as Who[]).map((
        who,
      ) => [who, { secret_b64: CHAIN_VECTOR_SEEDS[who], public_b64: ids[who].publicKey }]),
    ),
    valid,
    invalid,
  };
}

/** The file's text: what chainVectors makes, one space of indent as vectors/v2.json. */
export async function chainVectorsText(): Promise<string> {
  return JSON.stringify(await chainVectors(), null, 1) + "\n";
}

if (import.meta.main) {
  const file = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "vectors", "chain-v1.json");
  fs.writeFileSync(file, await chainVectorsText());
  console.log(`wrote ${file}`);
}
