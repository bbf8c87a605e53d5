// node --test against a Tidewire server (TIDEWIRE_URL, TIDEWIRE_API_KEY; set by
// tests/test_client_js.py): streamChat over HTTP, resumed after a dropped connection.
import assert from "node:assert/strict";
import { test } from "node:test";

import { AuthenticationError, streamChat } from "../src/index.js";

const wsUrl = process.env.TIDEWIRE_URL;
const apiKey = process.env.TIDEWIRE_API_KEY;
const skip = wsUrl ? false : "TIDEWIRE_URL is not set";
const base = wsUrl?.replace(/^ws/, "http").replace(/\/ws$/, "");
const ask = [{ role: "user", content: "Write a long story about a lighthouse keeper." }];
const params = { max_tokens: 48, temperature: 0, ignore_eos: true };
const text = (chunks) => chunks.map((c) => c.choices?.[0]?.delta?.content ?? "").join("");

async function collect(iterable) {
  const out = [];
  for await (const x of iterable) out.push(x);
  return out;
}

test("streamChat picks a dropped stream up again by Last-Event-ID", { skip }, async () => {
  const whole = await collect(streamChat(base, ask, { apiKey, ...params }));
  // a fetch whose first response breaks off after three events
  const calls = [];
  const flaky = async (url, init) => {
    calls.push({ url, lastEventId: init.headers?.["last-event-id"] });
    const res = await fetch(url, init);
    if (calls.length > 1) return res;
    const reader = res.body.getReader();
    let events = 0;
    const body = new ReadableStream({
      async pull(ctl) {
        const { value, done } = await reader.read();
        if (done) return ctl.close();
        events += (new TextDecoder().decode(value).match(/\n\n/g) ?? []).length;
        if (events >= 3) {
          await reader.cancel();
          return ctl.error(new TypeError("terminated"));
        }
        ctl.enqueue(value);
      },
    });
    return new Response(body, { status: res.status, headers: res.headers });
  };
  const got = await collect(streamChat(base, ask, { apiKey, fetch: flaky, ...params }));
  assert.equal(calls.length, 2);
  assert.match(calls[1].url, /\/chat\/completions\/chatcmpl-[0-9a-f]+\/events$/);
  assert.match(calls[1].lastEventId, /^\d+:\d+$/);
  assert.equal(text(got), text(whole));
  assert.equal(got.at(-1).choices[0].finish_reason, "length");
});

test("streamChat raises the server's refusals", { skip }, async () => {
  await assert.rejects(collect(streamChat(base, ask, { apiKey: "sk-wrong", ...params })),
                       AuthenticationError);
});
