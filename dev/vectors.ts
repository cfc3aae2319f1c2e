/**
 * dev/vectors.ts: writes vectors/chain-v1.json, the test vectors of the chain a
 * sub-task's request carries beside the signed fields (docs/wire.md, "Delegation
 * across hops"), and vectors/seal-v1.json, those of sealed messages (docs/wire.md,
 * "Sealed messages": the X25519 keys of Ed25519 ones, a message sealed with a fixed
 * ephemeral key, each step's bytes, and boxes that must not open). Keys come from fixed seeds (alice's and bob's are those of
 * vectors/v2.json) and Ed25519 is deterministic, so the file is the same on
 * every run; a test holds the file to what this makes and checks every vector.
 * Run it as `bun dev/vectors.ts` after changing the chain's or the seal's bytes (and say so in
 * docs/wire.md: other implementations check against the file).
 */

import * as fs from "node:fs";
import * as path from "node:path";
import { fileURLToPath } from "node:url";
import {
  b64urlDecode,
  b64urlEncode,
  canonicalBytes,
  type Chain,
  CHAIN_DOMAIN,
  chainBytes,
  type Identity,
  identityFromSeed,
  SEAL_DOMAIN,
  sealedData,
  sealMessage,
  signChain,
  type SignedMessage,
  signMessage,
  x25519Public,
  x25519Scalar,
  x25519Secret,
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

/** A fixed ephemeral X25519 secret for each sealed vector (never fixed in use: sealMessage makes one per message). */
const EPHEMERAL_HEX = ["a0".repeat(31) + "41", "5e".repeat(32)] as const;

/**
 * The seal's steps, computed here apart from sealMessage (a second reading of docs/wire.md): the test holds
 * sealMessage's output to them.
 */
async function sealSteps(msg: SignedMessage, ephemeralHex: string, chainJson: string) {
  const u8 = (b: ArrayBuffer) => new Uint8Array(b);
  const eph = await x25519Secret(Buffer.from(ephemeralHex, "hex"), true);
  const ephPub = b64urlDecode((await crypto.subtle.exportKey("jwk", eph)).x, 32, "ephemeral");
  const rcpt = x25519Public(msg.to) as Uint8Array<ArrayBuffer>;
  const other = await crypto.subtle.importKey("raw", rcpt, { name: "X25519" }, false, []);
  const shared = u8(await crypto.subtle.deriveBits({ name: "X25519", public: other }, eph, 256));
  const ikm = await crypto.subtle.importKey("raw", shared, "HKDF", false, ["deriveBits"]);
  const salt = new Uint8Array([...ephPub, ...rcpt]), info = new TextEncoder().encode(SEAL_DOMAIN);
  const okm = u8(await crypto.subtle.deriveBits({ name: "HKDF", hash: "SHA-256", salt, info }, ikm, 352));
  const lp = (s: string) => {
    const b = new TextEncoder().encode(s), n = new Uint8Array(4);
    new DataView(n.buffer).setUint32(0, b.length, true);
    return [...n, ...b];
  };
  const fields = [msg.text, msg.status ?? "", msg.task_id ?? "", msg.in_reply_to ?? "", chainJson];
  const content = [...b64urlDecode(msg.sig, 64, "sig"), ...fields.flatMap(lp)];
  let size = 512;
  while (size < content.length) size *= 4; // the vectors stay in the first classes
  const plaintext = new Uint8Array(size);
  plaintext.set(content);
  return {
    ephemeral_public_hex: hex(ephPub),
    recipient_x25519_hex: hex(rcpt),
    shared_hex: hex(shared),
    aes_key_hex: hex(okm.slice(0, 32)),
    nonce_hex: hex(okm.slice(32)),
    aad_hex: hex(sealedData(msg)),
    plaintext_hex: hex(plaintext),
  };
}

/** The sealing vectors as vectors/seal-v1.json holds them. */
export async function sealVectors(): Promise<object> {
  const ids = {} as Record<Who, Identity>;
  for (const who of Object.keys(CHAIN_VECTOR_SEEDS) as Who[]) {
    ids[who] = await identityFromSeed(b64urlDecode(CHAIN_VECTOR_SEEDS[who], 32, "seed"));
  }
  const { alice, bob, carol, dave } = ids;
  const T0 = 1767225600000;
  const keys = Object.fromEntries(
    await Promise.all((Object.keys(ids) as Who[]).map(async (who) => [who, {
      secret_b64: CHAIN_VECTOR_SEEDS[who],
      public_b64: ids[who].publicKey,
      x25519_secret_hex: hex(await x25519Scalar(b64urlDecode(CHAIN_VECTOR_SEEDS[who], 32, "seed"))),
      x25519_public_hex: hex(x25519Public(ids[who].publicKey) as Uint8Array),
    }])),
  );
  const hello = await signMessage(alice, {
    to: bob.publicKey,
    text: "the deploy key is in ~/secrets/deploy.pem",
    msg_id: "5ea1ed0000000000000000000000a11c",
  }, T0);
  const task = await signMessage(bob, {
    to: carol.publicKey,
    text: "render the logo in three sizes",
    msg_id: "5ea1ed000000000000000000000b0b01",
    task_id: "logo",
  }, T0 + 1000);
  const chain = await signChain(bob, task, {
    parent: "site",
    requester: alice.publicKey,
    owner: alice.publicKey,
    depth: 2,
    keys: [alice.publicKey, bob.publicKey],
  });
  const valid = [];
  for (
    const [i, v] of [{ name: "alice to bob, a chat message", msg: hello }, {
      name: "bob to carol, a request opening a sub-task, its chain sealed with it",
      msg: task,
      chain,
    }].entries()
  ) {
    const payload = await sealMessage(v.chain ? bob : alice, v.msg, v.chain, Buffer.from(EPHEMERAL_HEX[i], "hex"));
    valid.push({
      name: v.name,
      inner: v.msg,
      ...(v.chain ? { chain: v.chain } : {}),
      ephemeral_secret_hex: EPHEMERAL_HEX[i],
      ...(await sealSteps(v.msg, EPHEMERAL_HEX[i], v.chain ? JSON.stringify(v.chain) : "")),
      payload,
      canonical_hex: hex(canonicalBytes(payload)),
    });
  }
  // Each invalid one is signed by its sender (the outer signature verifies): only what is sealed is wrong.
  const sealed = valid[0].payload, box = Buffer.from(sealed.text, "base64url");
  const resign = (text: string, fields: Partial<SignedMessage> = {}) =>
    signMessage(alice, { to: bob.publicKey, kind: "sealed", msg_id: sealed.msg_id, text, ...fields }, T0);
  const flipped = Buffer.from(box);
  flipped[100] ^= 1;
  const toCarol = await sealMessage(
    alice,
    { ...hello, to: carol.publicKey },
    undefined,
    Buffer.from(EPHEMERAL_HEX[0], "hex"),
  );
  const smallOrder = Buffer.concat([Buffer.alloc(32), box.subarray(32)]);
  const forged = await signMessage(dave, { to: bob.publicKey, text: hello.text, msg_id: hello.msg_id }, T0);
  const invalid = [
    { name: "a byte of the box changed", why: "the AEAD's tag", payload: await resign(b64urlEncode(flipped)) },
    {
      name: "sealed to carol, sent to bob",
      why: "the key derivation and the AEAD data bind the recipient",
      payload: await resign(toCarol.text),
    },
    {
      name: "the box cut short",
      why: "a box holds the ephemeral key, a size class and a tag",
      payload: await resign(b64urlEncode(box.subarray(0, 300))),
    },
    {
      name: "moved to another msg_id",
      why: "the AEAD data binds the msg_id",
      payload: await resign(sealed.text, { msg_id: "5ea1ed0000000000000000000000a11d" }),
    },
    {
      name: "an ephemeral key of small order (zero)",
      why: "its shared secret would be known to anyone",
      payload: await resign(b64urlEncode(smallOrder)),
    },
    {
      name: "what it holds signed by another key (dave), sealed by alice",
      why: "the inner signature is the sender's",
      payload: await sealMessage(alice, { ...hello, sig: forged.sig }, undefined, Buffer.from(EPHEMERAL_HEX[0], "hex")),
    },
  ];
  return {
    about:
      "interlink seal-v1 vectors (docs/wire.md, 'Sealed messages'). Keys derive from the seeds (as chain-v1.json); x25519_* are their X25519 keys (the secret: SHA-512 of the seed, first half, clamped; the public: u = (1 + y) / (1 - y) mod p). Each valid payload is sealed with the fixed ephemeral secret given (never fixed in use): it verifies as a v2 message of kind 'sealed' (canonical_hex, the bytes its sig covers), opens with its recipient's key to plaintext_hex (inner's signature, then its text, status, task_id, in_reply_to and chain JSON, each u32le-length-prefixed, zeros to a size class) and to inner, a v2 message that verifies. Each invalid payload's outer signature verifies; it must not open.",
    domain: SEAL_DOMAIN,
    keys,
    valid,
    invalid,
  };
}

/** The file's text: what sealVectors makes, as chainVectorsText. */
export async function sealVectorsText(): Promise<string> {
  return JSON.stringify(await sealVectors(), null, 1) + "\n";
}

if (import.meta.main) {
  const dir = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "vectors");
  for (const [name, text] of [["chain-v1.json", await chainVectorsText()], ["seal-v1.json", await sealVectorsText()]]) {
    fs.writeFileSync(path.join(dir, name), text);
    console.log(`wrote ${path.join(dir, name)}`);
  }
}
