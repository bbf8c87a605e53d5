// @tidewire/client: the tidewire.v1 WebSocket protocol for browsers and Node.
//
// One socket carries any number of concurrent streams. Types are in index.d.ts.
// Runtime dependencies: @msgpack/msgpack (only loaded for protocol "msgpack") and, on
// Node versions without a global WebSocket, the optional `ws` package.

const SUBPROTOCOLS = { json: "tidewire.v1.json", msgpack: "tidewire.v1.msgpack" };
const AUTH_PREFIX = "tidewire.auth.";

// -- errors ------------------------------------------------------------------------------

export class TidewireError extends Error {
  constructor(message) {
    super(message);
    this.name = new.target.name;
  }
}

/** The server answered with an `error` frame. */
export class APIError extends TidewireError {
  constructor(code, message, retryable = false, requestId = undefined, retryAfter = undefined) {
    super(`${code}: ${message}`);
    this.code = code;
    this.retryable = retryable;
    this.requestId = requestId;
    // seconds until the same request may succeed (`rate_limited`)
    this.retryAfter = retryAfter;
  }
}
export class AuthenticationError extends APIError {}
export class BadRequestError extends APIError {}
export class NotFoundError extends BadRequestError {}
export class RateLimitError extends APIError {}
export class OverloadedError extends RateLimitError {}
export class SlowConsumerError extends APIError {}
export class InternalServerError extends APIError {}
export class APIConnectionError extends TidewireError {}
export class APITimeoutError extends APIConnectionError {}

const BY_CODE = {
  unauthorized: AuthenticationError,
  invalid_request: BadRequestError,
  duplicate_id: BadRequestError,
  context_length_exceeded: BadRequestError,
  message_too_big: BadRequestError,
  model_not_found: NotFoundError,
  too_many_inflight: RateLimitError,
  rate_limited: RateLimitError,
  overloaded: OverloadedError,
  slow_consumer: SlowConsumerError,
  internal_error: InternalServerError,
  unknown_id: BadRequestError,
};

/** The exception for an `error {id?, code, message, retryable, retry_after?}` frame. */
export function errorFromFrame(frame) {
  const Cls = BY_CODE[frame.code] ?? APIError;
  const retryAfter = typeof frame.retry_after === "number" ? frame.retry_after : undefined;
  return new Cls(frame.code, frame.message ?? "", Boolean(frame.retryable), frame.id, retryAfter);
}

// -- helpers -----------------------------------------------------------------------------

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = "";
  for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

async function webSocketClass() {
  if (typeof globalThis.WebSocket === "function") return globalThis.WebSocket;
  try {
    return (await import("ws")).default;
  } catch {
    throw new APIConnectionError("no WebSocket implementation: install the `ws` package");
  }
}

/** A queue that async iteration waits on. */
class Channel {
  constructor() {
    this.items = [];
    this.waiters = [];
  }
  push(item) {
    const w = this.waiters.shift();
    if (w) w(item);
    else this.items.push(item);
  }
  next(timeoutMs) {
    if (this.items.length) return Promise.resolve(this.items.shift());
    return new Promise((resolve, reject) => {
      let timer;
      const done = (item) => {
        clearTimeout(timer);
        resolve(item);
      };
      this.waiters.push(done);
      if (timeoutMs > 0) {
        timer = setTimeout(() => {
          this.waiters = this.waiters.filter((w) => w !== done);
          reject(new APITimeoutError(`no event for ${timeoutMs} ms`));
        }, timeoutMs);
      }
    });
  }
}

// -- streams -----------------------------------------------------------------------------

const END = Symbol("end");

/**
 * The events of one request: `for await (const ev of stream)` yields start, delta and
 * done events (and `queued`); `stream.textStream()` only the text; `await
 * stream.final()` the whole result. Breaking out of the loop, `stream.cancel()` or the
 * request's AbortSignal cancels the request on the server.
 */
export class Stream {
  constructor(client, id, signal, request = null) {
    this.id = id;
    // what a resume needs on a server that never saw the request (another replica): the
    // generate's fields, and every token id received so far
    this._request = request;
    this.receivedTokenIds = [];
    this.start = null;
    this.done = null;
    this._client = client;
    this._chan = new Channel();
    this._finished = false;
    this._texts = [];
    this._reasonings = [];
    this._tokens = [];
    this.lastSeq = 0; // of the newest delta received: where a resume picks up
    if (signal) {
      const onAbort = () => this.cancel();
      if (signal.aborted) queueMicrotask(onAbort);
      else signal.addEventListener("abort", onAbort, { once: true });
    }
  }

  _push(item) {
    this._chan.push(item);
  }

  /** The next event, or null at the end. */
  async nextEvent() {
    if (this._finished) return null;
    let item;
    try {
      item = await this._chan.next(this._client.timeoutMs);
    } catch (e) {
      this.close();
      throw e;
    }
    if (item === END) {
      this._finished = true;
      return null;
    }
    if (item instanceof Error) {
      this._finished = true;
      throw item;
    }
    if (item.type === "start") this.start = item;
    else if (item.type === "delta") {
      const i = item.index ?? 0;
      (this._texts[i] ??= []).push(item.text);
      if (item.reasoning) (this._reasonings[i] ??= []).push(item.reasoning);
      (this._tokens[i] ??= []).push(...item.token_ids);
    } else if (item.type === "done") {
      this.done = item;
      this._finished = true;
    }
    return item;
  }

  [Symbol.asyncIterator]() {
    return {
      next: async () => {
        const ev = await this.nextEvent();
        return ev === null ? { done: true, value: undefined } : { done: false, value: ev };
      },
      return: async () => {
        this.close(); // the loop was left early
        return { done: true, value: undefined };
      },
    };
  }

  /** Only the text of each delta (a thinking model's answer, without its reasoning). */
  async *textStream() {
    for await (const ev of this) {
      if (ev.type === "delta" && ev.text) yield ev.text;
    }
  }

  /** Read to the end; the whole result. */
  async final() {
    while ((await this.nextEvent()) !== null);
    const n = Math.max(this._texts.length, this._tokens.length, this._reasonings.length, 1);
    const texts = Array.from({ length: n }, (_, i) => (this._texts[i] ?? []).join(""));
    const reasonings = Array.from({ length: n }, (_, i) => (this._reasonings[i] ?? []).join(""));
    return {
      id: this.id,
      text: texts[0],
      texts,
      // a thinking model's reasoning ("" when it thought nothing); text is then the answer
      reasoning: reasonings[0],
      reasonings,
      tokenIds: Array.from({ length: n }, (_, i) => this._tokens[i] ?? []),
      status: this.done.status,
      finishReason: this.done.finish_reason,
      usage: this.done.usage,
      timings: this.done.timings,
      cachedTokens: this.start?.cached_tokens ?? { device: 0, host: 0 },
      // with tools: the calls, whole, and the text outside them
      toolCalls: this.done.tool_calls,
      content: this.done.content,
    };
  }

  /** Ask the server to stop; the stream then ends with a `cancelled` done event. */
  cancel() {
    if (!this._finished) this._client._sendSoon({ type: "cancel", id: this.id });
  }

  /** Stop listening and cancel the request (no more events are delivered). */
  close() {
    if (this._finished) return;
    this._finished = true;
    this._client._abandon(this.id);
    this._chan.push(END);
  }
}

// -- the client --------------------------------------------------------------------------

/**
 * A Tidewire client on one WebSocket.
 *   new TidewireClient({ url, apiKey, protocol: "json" | "msgpack", timeoutMs, maxRetries })
 * The key travels as the subprotocol `tidewire.auth.<base64url key>` (browsers cannot set
 * headers on a WebSocket); the server never echoes it. The socket opens on first use and
 * reopens, with backoff, for new requests after it drops. With `resume` (default true),
 * streams in flight when the connection drops (not by close()) are resumed on a new
 * socket from their last delta, when the server offers resume: no gap, no duplicate.
 * Each resume carries its request and the token ids received, so a server that never ran
 * it (another replica behind a load balancer, or one restarted) continues it.
 * `affinity`: the routing key for a load balancer to hash (same key, same replica), sent
 * as the `affinity` query parameter of the socket's URL and, where the WebSocket class
 * can set headers (Node's `ws`), as the `X-Tidewire-Affinity` header. Default: one random
 * key per client, kept across reconnects; give a conversation id to pin a conversation.
 */
export class TidewireClient {
  constructor({ url, apiKey, protocol = "json", timeoutMs = 60000, maxRetries = 3, resume = true, affinity } = {}) {
    if (!url) throw new TypeError("url is required");
    if (!SUBPROTOCOLS[protocol]) throw new TypeError('protocol must be "json" or "msgpack"');
    affinity ??= Math.random().toString(36).slice(2) + Math.random().toString(36).slice(2);
    Object.assign(this, { url, apiKey, protocol, timeoutMs, maxRetries, resume, affinity });
    this._closing = false;
    this.ready = null;
    this._ws = null;
    this._opening = null;
    this._streams = new Map();
    this._waiters = new Map();
    this._seq = 0;
    this._prefix = Math.random().toString(36).slice(2, 10);
    this._codec = null;
    this.chat = {
      stream: (opts) => this._generate("messages", opts),
      create: async (opts) => (await this._generate("messages", opts)).final(),
    };
    this.completions = {
      stream: (opts) => this._generate("prompt", opts),
      create: async (opts) => (await this._generate("prompt", opts)).final(),
    };
  }

  get connected() {
    return this._ws !== null && this._ws.readyState === 1;
  }

  /** Open the socket (retrying with backoff) and wait for the server's `ready`. */
  async connect() {
    if (this.connected) return;
    this._opening ??= this._connectWithRetries().finally(() => {
      this._opening = null;
    });
    return this._opening;
  }

  async _connectWithRetries() {
    let delay = 250;
    for (let attempt = 0; ; attempt++) {
      try {
        return await this._open();
      } catch (e) {
        if (e instanceof AuthenticationError || attempt >= this.maxRetries) throw e;
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 4000);
      }
    }
  }

  async _loadCodec() {
    if (this._codec) return this._codec;
    if (this.protocol === "json") {
      this._codec = { encode: (m) => JSON.stringify(m), decode: (d) => JSON.parse(d) };
    } else {
      const mp = await import("@msgpack/msgpack");
      this._codec = {
        encode: (m) => mp.encode(m),
        decode: (d) => mp.decode(typeof d === "string" ? new TextEncoder().encode(d) : d),
      };
    }
    return this._codec;
  }

  async _open() {
    const WS = await webSocketClass();
    const codec = await this._loadCodec();
    const protocols = [SUBPROTOCOLS[this.protocol]];
    if (this.apiKey) protocols.push(AUTH_PREFIX + base64url(this.apiKey));
    const target = new URL(this.url);
    target.searchParams.set("affinity", this.affinity);
    const ws = WS === globalThis.WebSocket
      ? new WS(target.href, protocols)
      : new WS(target.href, protocols, { headers: { "X-Tidewire-Affinity": this.affinity } });
    ws.binaryType = "arraybuffer";
    let status = 0;
    if (typeof ws.on === "function") {
      ws.on("unexpected-response", (_req, res) => {
        status = res.statusCode;
        ws.terminate?.();
      });
    }
    await new Promise((resolve, reject) => {
      const fail = (why) => {
        if (status === 401 || status === 403) {
          reject(new AuthenticationError("unauthorized", "the server refused the API key or origin"));
        } else reject(new APIConnectionError(`cannot connect to ${this.url}: ${why}`));
      };
      ws.onopen = null;
      ws.onmessage = (msg) => {
        const frame = codec.decode(toData(msg.data));
        if (frame.type !== "ready") return fail(`expected ready, got ${frame.type}`);
        this.ready = frame;
        resolve();
      };
      ws.onerror = () => fail("socket error");
      ws.onclose = (ev) =>
        ev.code === 1008 ? reject(new AuthenticationError("unauthorized", ev.reason || "policy"))
          : fail(`closed (${ev.code})`);
    });
    this._ws = ws;
    this._closing = false;
    ws.onmessage = (msg) => this._route(codec.decode(toData(msg.data)));
    ws.onerror = () => {};
    ws.onclose = (ev) => this._dropped(ws, ev);
  }

  _dropped(ws, ev) {
    const err = new APIConnectionError(`connection lost (${ev.code})`);
    const ready = this.ready ?? {};
    const resumable = this.resume && !this._closing && this._streams.size > 0 &&
      (ready.features ?? []).includes("resume") && ![1000, 1008, 1009].includes(ev.code);
    if (!resumable) return this._lost(ws, err);
    const streams = new Map(this._streams);
    this._streams.clear();
    this._lost(ws, err);
    this._recover(streams, ready.session_id, err);
  }

  /** Reconnect and resume the streams the dropped socket carried (the server parked
   * them meanwhile); each goes on from the last delta it received. */
  async _recover(streams, sessionId, err) {
    try {
      await this.connect();
      for (const [id, s] of streams) {
        if (s._finished) continue; // closed by its reader meanwhile: the server lets it expire
        this._streams.set(id, s);
        const frame = { type: "resume", id, after_seq: s.lastSeq, session_id: sessionId };
        if (s._request) Object.assign(frame, { request: s._request, token_ids: [...s.receivedTokenIds] });
        this._send(frame);
      }
    } catch (e) {
      for (const [id, s] of streams) {
        if (this._streams.get(id) === s) this._streams.delete(id);
        s._push(e instanceof APIConnectionError ? e : err);
      }
    }
  }

  _lost(ws, err) {
    if (this._ws === ws) this._ws = null;
    for (const s of this._streams.values()) s._push(err);
    this._streams.clear();
    for (const w of this._waiters.values()) w.reject(err);
    this._waiters.clear();
  }

  _route(frame) {
    const { type, id } = frame;
    if (type === "queued" || type === "start" || type === "delta" || type === "done") {
      const s = this._streams.get(id);
      if (s) {
        if (type === "delta") {
          s.lastSeq = frame.seq;
          for (const t of frame.token_ids ?? []) s.receivedTokenIds.push(t);
        }
        s._push(frame);
        if (type === "done") this._streams.delete(id);
      }
    } else if (type === "error") {
      const err = errorFromFrame(frame);
      if (this._streams.has(id)) {
        this._streams.get(id)._push(err);
        this._streams.delete(id);
      } else if (this._waiters.has(id)) {
        this._waiters.get(id).reject(err);
        this._waiters.delete(id);
      }
    } else if (type === "warmed" || type === "pong") {
      const key = type === "warmed" ? id : `ping:${frame.t}`;
      this._waiters.get(key)?.resolve(frame);
      this._waiters.delete(key);
    } else if (type === "resumed") {
      // nothing to do: _recover registered the stream again; the missed deltas follow
    }
  }

  _send(frame) {
    if (!this.connected) throw new APIConnectionError("not connected");
    this._ws.send(this._codec.encode(frame));
  }

  _sendSoon(frame) {
    try {
      this._send(frame);
    } catch {
      /* the socket is gone: the server has already aborted everything */
    }
  }

  _abandon(id) {
    if (this._streams.delete(id)) this._sendSoon({ type: "cancel", id });
  }

  _newId() {
    return `${this._prefix}-${++this._seq}`;
  }

  async _generate(kind, opts = {}) {
    const { messages, prompt, requestId, signal, ...params } = opts;
    const body = {};
    if (kind === "messages") body.messages = messages;
    else if (Array.isArray(prompt)) body.prompt_token_ids = prompt;
    else body.prompt = prompt;
    await this.connect();
    const id = requestId ?? this._newId();
    if (this._streams.has(id)) throw new BadRequestError("duplicate_id", `request ${id} is in flight`);
    // only a single-sample request without tools can continue on a server that never saw it
    const portable = (params.n ?? 1) === 1 && !params.tools;
    const stream = new Stream(this, id, signal, portable ? { ...body, params } : null);
    this._streams.set(id, stream);
    try {
      this._send({ type: "generate", id, ...body, params });
    } catch (e) {
      this._streams.delete(id);
      throw e;
    }
    return stream;
  }

  async _request(key, frame) {
    await this.connect();
    const reply = new Promise((resolve, reject) => this._waiters.set(key, { resolve, reject }));
    this._send(frame);
    let timer;
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new APITimeoutError(`no reply to ${frame.type}`)), this.timeoutMs);
    });
    try {
      return await Promise.race([reply, timeout]);
    } finally {
      clearTimeout(timer);
      this._waiters.delete(key);
    }
  }

  /** Prefill a prefix (`{messages}` or `{prompt}`) into the server's cache without
   * generating; resolves to {prompt_tokens, cached_tokens, reused_tokens}. */
  async warm({ messages, prompt } = {}) {
    const id = this._newId();
    const body = messages ? { messages } : Array.isArray(prompt) ? { prompt_token_ids: prompt } : { prompt };
    const r = await this._request(id, { type: "warm", id, ...body });
    return { prompt_tokens: r.prompt_tokens, cached_tokens: r.cached_tokens, reused_tokens: r.reused_tokens };
  }

  /** Round-trip time of a ping, in milliseconds. */
  async ping() {
    const t = `${Date.now()}.${++this._seq}`;
    const t0 = globalThis.performance?.now() ?? Date.now();
    await this._request(`ping:${t}`, { type: "ping", t });
    return (globalThis.performance?.now() ?? Date.now()) - t0;
  }

  /** Close the socket; open streams end with APIConnectionError. */
  /** Route later connections by `key`. When it changes and nothing streams, the socket
   * reopens now (under the new key), so the next request goes where the key points. */
  async setAffinity(key) {
    if (key === this.affinity) return;
    this.affinity = key;
    if (this._ws && this._streams.size === 0) {
      this.close();
      await this.connect();
    }
  }

  close() {
    this._closing = true;
    const ws = this._ws;
    if (ws) {
      this._lost(ws, new APIConnectionError("client closed"));
      ws.close(1000);
    }
  }
}

function toData(data) {
  return data instanceof ArrayBuffer ? new Uint8Array(data) : data;
}

// -- the HTTP API, resumed across drops --------------------------------------------------

/**
 * The chunks of a streamed `POST {baseUrl}/chat/completions` (OpenAI's chunk objects)
 * that opts in to resuming (`X-Tidewire-Resume: 1`): when the connection drops before
 * `[DONE]`, it reconnects to `GET .../{id}/events` with the last event's id as
 * `Last-Event-ID` and goes on where it was (the same server kept it running; behind a
 * balancer with the Redis tier, another replica continues it). `options`: `apiKey`,
 * `maxReconnects` (10), `fetch` (the global one by default), `signal` (an AbortSignal:
 * the iteration ends quietly), and the request's fields.
 */
export function streamChat(baseUrl, messages, options = {}) {
  const { apiKey, maxReconnects, fetch: f, signal, ...params } = options;
  return resumableStream(baseUrl, "chat/completions", { ...params, messages, stream: true },
                         { apiKey, maxReconnects, f, signal });
}

/** The same for `POST {baseUrl}/completions`. */
export function streamCompletion(baseUrl, prompt, options = {}) {
  const { apiKey, maxReconnects, fetch: f, signal, ...params } = options;
  return resumableStream(baseUrl, "completions", { ...params, prompt, stream: true },
                         { apiKey, maxReconnects, f, signal });
}

async function* resumableStream(baseUrl, path, body, { apiKey, maxReconnects = 10, f, signal }) {
  const fetchFn = f ?? globalThis.fetch;
  const base = `${baseUrl.replace(/\/+$/, "")}/${path}`;
  const headers = { "content-type": "application/json", accept: "text/event-stream",
                    "x-tidewire-resume": "1" };
  if (apiKey) headers.authorization = `Bearer ${apiKey}`;
  let streamId = null;
  let lastEventId = null;
  let retry = 500;
  let reconnects = 0;
  let res;
  try {
    res = await fetchFn(base, { method: "POST", headers, body: JSON.stringify(body), signal });
  } catch (e) {
    if (signal?.aborted) return;
    throw new APIConnectionError(`the request could not be sent: ${e}`);
  }
  let finished = false;
  try {
    for (;;) {
      if (!res.ok) throw await httpError(res);
      let cause;
      try {
        for await (const ev of sseEvents(res.body)) {
          if (ev.id !== undefined) lastEventId = ev.id;
          if (ev.retry !== undefined) retry = ev.retry;
          if (ev.data === undefined) continue;
          if (ev.data === "[DONE]") {
            finished = true;
            return;
          }
          const chunk = JSON.parse(ev.data);
          if (chunk.error && !chunk.choices) {
            finished = true;
            throw errorFromFrame(chunk.error);
          }
          streamId ??= chunk.id;
          yield chunk;
        }
        cause = new Error("the stream ended before [DONE]");
      } catch (e) {
        if (e instanceof TidewireError) throw e;
        if (signal?.aborted) return;
        cause = e;
      }
      if (streamId === null || lastEventId === null) {
        throw new APIConnectionError(`the stream dropped before its first event: ${cause}`);
      }
      for (;;) {
        if (++reconnects > maxReconnects) {
          throw new APIConnectionError(`the stream dropped ${maxReconnects} times; giving up: ${cause}`);
        }
        await new Promise((resolve) => setTimeout(resolve, retry));
        if (signal?.aborted) return;
        try {
          res = await fetchFn(`${base}/${streamId}/events`,
                              { headers: { ...headers, "last-event-id": lastEventId }, signal });
          break;
        } catch (e) {
          if (signal?.aborted) return;
          cause = e;
        }
      }
    }
  } finally {
    // left before its end (aborted, or the caller stopped iterating): the server would
    // run it on for its grace; say it is not wanted (best effort)
    if (!finished && streamId !== null) {
      fetchFn(`${base}/${streamId}/events`, { method: "DELETE", headers }).catch(() => {});
    }
  }
}

/** The events of a server-sent event body: {data, id, retry} (fields as given). */
async function* sseEvents(body) {
  const decoder = new TextDecoder();
  let buffer = "";
  let ev = {};
  for await (const bytes of body) {
    buffer += decoder.decode(bytes, { stream: true });
    let at;
    while ((at = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, at).replace(/\r$/, "");
      buffer = buffer.slice(at + 1);
      if (line === "") {
        if (Object.keys(ev).length) yield ev;
        ev = {};
        continue;
      }
      const colon = line.indexOf(":");
      const name = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (name === "data") ev.data = ev.data === undefined ? value : `${ev.data}\n${value}`;
      else if (name === "id") ev.id = value;
      else if (name === "retry" && /^\d+$/.test(value)) ev.retry = Number(value);
    }
  }
}

async function httpError(res) {
  let err = {};
  try {
    err = (await res.json()).error ?? {};
  } catch {
    // not JSON: the status says it
  }
  return errorFromFrame({ code: err.code ?? `http_${res.status}`, message: err.message ?? res.statusText });
}

export default TidewireClient;
