// One chat stream through the JS SDK, printed as JSON lines (for tests and for trying a
// deployment by hand):
//   node scripts/stream.mjs <ws url> '<request as JSON: {messages, ...params}>' [affinity]
// Each line is {t, type, ...}: `t` is Date.now() when the event arrived; `ready` after
// the socket opened, every event of the stream, then `end` with the received token ids.
import { TidewireClient } from "../src/index.js";

const [url, request, affinity] = process.argv.slice(2);
const out = (o) => process.stdout.write(JSON.stringify({ t: Date.now(), ...o }) + "\n");
const client = new TidewireClient({ url, affinity, maxRetries: 8 });
try {
  await client.connect();
  out({ type: "ready", session_id: client.ready.session_id });
  const stream = await client.chat.stream(JSON.parse(request));
  for await (const ev of stream) out(ev);
  out({ type: "end", token_ids: stream.receivedTokenIds, session_id: client.ready.session_id });
} catch (e) {
  out({ type: "exception", name: e.name, message: e.message, code: e.code });
  process.exitCode = 1;
} finally {
  client.close();
}
