// node --test against a Tidewire server on a thinking model (its chat template opens
// <think>): TIDEWIRE_THINKING_URL is set by tests/test_reasoning_service.py, which
// starts it. Without it (the default model's suite) these tests are skipped.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import { TidewireClient } from "../src/index.js";

const url = process.env.TIDEWIRE_THINKING_URL;
const skip = url ? false : "TIDEWIRE_THINKING_URL is not set";
const ask = [{ role: "user", content: "What is the capital of France?" }];
// the constraint writes the thinking and the answer itself (a random model would not)
const FORCED = { type: "regex", regex: "<think>Let me think\\.</think>\\n\\nParis\\." };
const clients = [];
function client(opts = {}) {
  const c = new TidewireClient({ url, ...opts });
  clients.push(c);
  return c;
}
after(() => clients.forEach((c) => c.close()));

for (const protocol of ["json", "msgpack"]) {
  test(`deltas carry the reasoning apart from the answer (${protocol})`, { skip }, async () => {
    const c = client({ protocol });
    await c.connect();
    assert.ok(c.ready.features.includes("reasoning"));
    const stream = await c.chat.stream({ messages: ask, max_tokens: 32, temperature: 0, response_format: FORCED });
    const deltas = [];
    for await (const ev of stream) if (ev.type === "delta") deltas.push(ev);
    assert.equal(deltas.map((d) => d.reasoning ?? "").join(""), "Let me think.");
    assert.equal(deltas.map((d) => d.text).join(""), "Paris.");
    // the thinking comes first: no reasoning after the answer started
    const firstText = deltas.findIndex((d) => d.text);
    assert.ok(deltas.slice(firstText + 1).every((d) => !d.reasoning));
    const whole = await c.chat.create({ messages: ask, max_tokens: 32, temperature: 0, response_format: FORCED });
    assert.equal(whole.reasoning, "Let me think.");
    assert.equal(whole.text, "Paris.");
    assert.deepEqual(whole.reasonings, ["Let me think."]);
    assert.equal(whole.finishReason, "stop");
  });
}

test("a thinking prompt's output is reasoning until it closes; enable_thinking: false turns it off", { skip }, async () => {
  const c = client();
  const thinking = await c.chat.create({ messages: ask, max_tokens: 8, temperature: 0, ignore_eos: true });
  assert.equal(thinking.finishReason, "length");
  assert.equal(thinking.text, ""); // a random model never writes </think>
  assert.ok(thinking.reasoning.length > 0);
  const plain = await c.chat.create({ messages: ask, max_tokens: 8, temperature: 0, ignore_eos: true, enable_thinking: false });
  assert.equal(plain.reasoning, "");
  assert.ok(plain.text.length > 0);
  assert.ok(plain.usage.prompt_tokens < thinking.usage.prompt_tokens); // no <think> in the prompt
});
