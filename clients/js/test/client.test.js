// node --test against a real Tidewire server: TIDEWIRE_URL (ws://.../v1/ws) and
// TIDEWIRE_API_KEY are set by tests/test_client_js.py, which starts the server.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import {
  AuthenticationError,
  BadRequestError,
  APIConnectionError,
  RateLimitError,
  TidewireClient,
  errorFromFrame,
} from "../src/index.js";

const url = process.env.TIDEWIRE_URL;
const apiKey = process.env.TIDEWIRE_API_KEY;
if (!url) throw new Error("set TIDEWIRE_URL (tests/test_client_js.py does)");
const ask = (content) => [{ role: "user", content }];
const clients = [];
function client(opts = {}) {
  const c = new TidewireClient({ url, apiKey, ...opts });
  clients.push(c);
  return c;
}
after(() => clients.forEach((c) => c.close()));

for (const protocol of ["json", "msgpack"]) {
  test(`streams start, deltas in order and one done (${protocol})`, async () => {
    const c = client({ protocol });
    const stream = await c.chat.stream({ messages: ask("Name three colors."), max_tokens: 12, temperature: 0 });
    const events = [];
    for await (const ev of stream) events.push(ev);
    assert.equal(events[0].type, "start");
    assert.equal(events.at(-1).type, "done");
    assert.equal(events.at(-1).status, "completed");
    const deltas = events.filter((e) => e.type === "delta");
    assert.deepEqual(deltas.map((d) => d.seq), deltas.map((_, i) => i + 1));
    const text = deltas.map((d) => d.text).join("");
    assert.ok(text.length > 0);
    const whole = await c.chat.create({ messages: ask("Name three colors."), max_tokens: 12, temperature: 0 });
    assert.equal(whole.text, text); // greedy: the same text twice
    assert.equal(whole.usage.completion_tokens, deltas.flatMap((d) => d.token_ids).length);
  });
}

test("concurrent streams share one socket", async () => {
  const c = client();
  const qs = ["Count to three.", "Say hello.", "Name a fruit.", "What is 1+1?"];
  const solo = [];
  for (const q of qs) solo.push((await c.chat.create({ messages: ask(q), max_tokens: 10, temperature: 0 })).text);
  const texts = await Promise.all(
    qs.map(async (q) => {
      const s = await c.chat.stream({ messages: ask(q), max_tokens: 10, temperature: 0 });
      let t = "";
      for await (const piece of s.textStream()) t += piece;
      assert.equal(s.done.status, "completed");
      return t;
    }),
  );
  assert.deepEqual(texts, solo);
});

test("completions with a text prompt and warm", async () => {
  const c = client();
  const r = await c.completions.create({ prompt: "The sea is", max_tokens: 6, ignore_eos: true, temperature: 0 });
  assert.equal(r.finishReason, "length");
  assert.equal(r.usage.completion_tokens, 6);
  const w = await c.warm({ messages: [{ role: "system", content: "Be brief. ".repeat(20) }] });
  assert.ok(w.cached_tokens >= 16, JSON.stringify(w));
  assert.ok((await c.ping()) >= 0);
});

test("AbortSignal cancels: the stream ends with a cancelled done", async () => {
  const c = client();
  const ac = new AbortController();
  const s = await c.chat.stream({ messages: ask("Count to 100."), max_tokens: 400, ignore_eos: true, signal: ac.signal });
  let deltas = 0;
  let last;
  for await (const ev of s) {
    last = ev;
    if (ev.type === "delta" && ++deltas === 2) ac.abort();
  }
  assert.equal(last.type, "done");
  assert.equal(last.status, "cancelled");
  assert.ok(deltas < 100);
});

async function aborted() {
  const metrics = await (await fetch(url.replace(/^ws/, "http").replace(/\/v1\/ws$/, "/metrics"))).text();
  const m = metrics.match(/^tidewire_requests_total\{finish_reason="abort"\} ([0-9.e+]+)$/m);
  return m ? Number(m[1]) : 0;
}

test("breaking out of the loop cancels on the server", async () => {
  const c = client();
  const before = await aborted();
  const s = await c.chat.stream({ messages: ask("Count to 100."), max_tokens: 400, ignore_eos: true });
  for await (const ev of s) if (ev.type === "delta") break;
  for (let i = 0; i < 100 && (await aborted()) === before; i++) await new Promise((r) => setTimeout(r, 50));
  assert.equal(await aborted(), before + 1); // the server aborted it
  const r = await c.chat.create({ messages: ask("Hi"), max_tokens: 3 }); // the socket still works
  assert.equal(r.status, "completed");
});

test("errors map to typed exceptions", async () => {
  const c = client();
  const bad = await c.chat.stream({ messages: ask("x"), temperature: -1 });
  await assert.rejects(bad.final(), (e) => e instanceof BadRequestError && e.code === "invalid_request");
  const streams = [];
  for (let i = 0; i < 5; i++) streams.push(await c.chat.stream({ messages: ask("Go on."), max_tokens: 200, ignore_eos: true }));
  await assert.rejects(streams[4].final(), (e) => e instanceof RateLimitError && e.retryable);
  streams.slice(0, 4).forEach((s) => s.close());
  const wrong = new TidewireClient({ url, apiKey: "wrong-key", maxRetries: 0 });
  await assert.rejects(wrong.connect(), AuthenticationError);
  const dead = new TidewireClient({ url: "ws://127.0.0.1:9/v1/ws", maxRetries: 0 });
  await assert.rejects(dead.chat.create({ messages: ask("x") }), APIConnectionError);
});

test("rate_limited maps to RateLimitError with retryAfter", () => {
  const e = errorFromFrame({ type: "error", code: "rate_limited", message: "m", retryable: true, id: "r", retry_after: 12.5 });
  assert.ok(e instanceof RateLimitError);
  assert.equal(e.retryAfter, 12.5);
  assert.equal(e.requestId, "r");
  assert.equal(errorFromFrame({ code: "overloaded", message: "m" }).retryAfter, undefined);
});

test("streams survive a dropped connection (resumed on a new socket)", async () => {
  const c = client({ protocol: "msgpack" });
  const params = { max_tokens: 32, temperature: 0, ignore_eos: true };
  const qs = ["Describe the sea.", "Describe a forest."];
  const want = [];
  for (const q of qs) want.push(await c.chat.create({ messages: ask(q), ...params }));
  const first = c.ready.session_id;
  const streams = await Promise.all(qs.map((q) => c.chat.stream({ messages: ask(q), ...params })));
  const got = qs.map(() => []);
  for (const [i, s] of streams.entries()) {
    while (got[i].length < 2) {
      const ev = await s.nextEvent();
      if (ev.type === "delta") got[i].push(ev);
    }
  }
  c._ws.terminate(); // the TCP connection dies without a close frame
  for (const [i, s] of streams.entries()) {
    for await (const ev of s) if (ev.type === "delta") got[i].push(ev);
    assert.equal(s.done.status, "completed");
    assert.equal(s.done.usage.completion_tokens, 32);
    assert.deepEqual(got[i].map((d) => d.seq), got[i].map((_, j) => j + 1));
    assert.equal(got[i].map((d) => d.text).join(""), want[i].text);
    assert.deepEqual(got[i].flatMap((d) => d.token_ids), want[i].tokenIds[0]);
  }
  assert.notEqual(c.ready.session_id, first);
});

test("a dropped stream continues on another server (failover through a proxy)", async () => {
  // TIDEWIRE_FAILOVER_URL: the first connection reaches the main server, every later one
  // a second server that never saw the request: the resume carries it and its tokens
  const failover = process.env.TIDEWIRE_FAILOVER_URL;
  assert.ok(failover, "set TIDEWIRE_FAILOVER_URL (tests/test_client_js.py does)");
  const params = { max_tokens: 32, temperature: 0, ignore_eos: true };
  const want = await client().chat.create({ messages: ask("Describe a river."), ...params });
  const c = client({ url: failover, affinity: "conversation-7" });
  const s = await c.chat.stream({ messages: ask("Describe a river."), ...params });
  const got = [];
  while (got.length < 2) {
    const ev = await s.nextEvent();
    if (ev.type === "delta") got.push(ev);
  }
  const first = c.ready.session_id;
  c._ws.terminate();
  for await (const ev of s) if (ev.type === "delta") got.push(ev);
  assert.notEqual(c.ready.session_id, first);
  assert.equal(s.done.status, "completed");
  assert.equal(s.done.usage.completion_tokens, 32);
  assert.deepEqual(got.map((d) => d.seq), got.map((_, j) => j + 1));
  assert.equal(got.map((d) => d.text).join(""), want.text);
  assert.deepEqual(s.receivedTokenIds, want.tokenIds[0]);
});

test("response_format takes a JSON schema; tool calls stream and come whole", async () => {
  const c = client();
  const schema = {
    type: "object",
    properties: { city: { type: "string", maxLength: 20 }, rank: { type: "integer", minimum: 1, maximum: 9 } },
    required: ["city", "rank"],
  };
  const r = await c.chat.create({
    messages: ask("Name a city as JSON."),
    max_tokens: 60,
    temperature: 0,
    response_format: { type: "json_schema", json_schema: { name: "city", schema } },
  });
  assert.equal(r.finishReason, "stop");
  const obj = JSON.parse(r.text);
  assert.equal(typeof obj.city, "string");
  assert.ok(obj.rank >= 1 && obj.rank <= 9);
  const tools = [{ type: "function", function: { name: "pick", parameters: { type: "object", properties: { n: { enum: [1, 2, 3] } }, required: ["n"] } } }];
  const s = await c.chat.stream({
    messages: ask("Pick a number."), max_tokens: 40, temperature: 0, tools, tool_choice: "required", parallel_tool_calls: false,
  });
  const frags = [];
  for await (const ev of s) if (ev.type === "delta") frags.push(...(ev.tool_calls ?? []));
  const whole = await s.final();
  assert.equal(whole.finishReason, "tool_calls");
  assert.equal(whole.toolCalls.length, 1);
  assert.equal(whole.toolCalls[0].function.name, "pick");
  assert.equal(frags[0].id, whole.toolCalls[0].id);
  assert.equal(frags.map((f) => f.function.arguments).join(""), whole.toolCalls[0].function.arguments);
  assert.ok([1, 2, 3].includes(JSON.parse(whole.toolCalls[0].function.arguments).n));
  await assert.rejects(
    c.chat.create({ messages: ask("x"), max_tokens: 4, response_format: { type: "regex", regex: "a(b" } }),
    (e) => e instanceof BadRequestError && e.code === "invalid_request" && /invalid regex/.test(e.message),
  );
});
