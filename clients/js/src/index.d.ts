// Types of @tidewire/client (hand-written beside src/index.js).

export interface CachedTokens {
  device: number;
  host: number;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  cached_tokens: CachedTokens;
}

export interface Timings {
  queue_ms: number;
  ttft_ms: number;
  tokens_per_s: number;
  total_ms: number;
}

export interface QueuedEvent {
  type: "queued";
  id: string;
  position: number;
}

export interface StartEvent {
  type: "start";
  id: string;
  prompt_tokens: number;
  cached_tokens: CachedTokens;
  queue_ms: number;
}

export interface DeltaEvent {
  type: "delta";
  id: string;
  /** +1 per delta of this request */
  seq: number;
  text: string;
  token_ids: number[];
  /** the sample, when n > 1 */
  index?: number;
  logprobs?: { token_id: number; logprob: number; top: [number, number][] }[];
  /** with tools: the tool-call deltas this text completed (OpenAI's streaming shape) */
  tool_calls?: ToolCallDelta[];
  /** a thinking model's reasoning that this delta adds (absent when none); `text` is
   * then the answer only */
  reasoning?: string;
}

/** A tool call, whole: `arguments` is a JSON string. */
export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
  /** the sample, when n > 1 */
  index?: number;
}

/** A piece of a streamed tool call: id, type and name come once (arguments ""), then
 * fragments of its arguments, under the same index. */
export interface ToolCallDelta {
  index: number;
  id?: string;
  type?: "function";
  function: { name?: string; arguments: string };
}

export interface DoneEvent {
  type: "done";
  id: string;
  status: "completed" | "cancelled" | "failed";
  finish_reason: "stop" | "length" | "tool_calls" | "cancelled" | "error";
  usage: Usage;
  timings: Timings;
  finish_reasons?: string[];
  /** with tools: every call, whole, and the text outside them (null when none) */
  tool_calls?: ToolCall[];
  content?: string | null | (string | null)[];
}

export type StreamEvent = QueuedEvent | StartEvent | DeltaEvent | DoneEvent;

export interface Message {
  role: "system" | "user" | "assistant" | "tool" | string;
  /** null for an assistant turn that only called tools */
  content: string | null;
  /** an assistant turn's calls */
  tool_calls?: ToolCall[];
  /** a tool turn: the call it answers */
  tool_call_id?: string;
}

/** A JSON Schema (draft 2020-12 subset that the server's grammar compiler takes). */
export type JSONSchema = Record<string, unknown> | boolean;

/** What the output must be: JSON matching a schema, any JSON object, text matching a
 * regex, one of some strings, or text of an EBNF grammar. */
export type ResponseFormat =
  | { type: "text" }
  | { type: "json_object" }
  | { type: "json_schema"; json_schema: { name?: string; schema: JSONSchema; strict?: boolean; description?: string } }
  | { type: "regex"; regex: string }
  | { type: "choice"; choice: string[] }
  | { type: "grammar"; grammar: string };

export interface Tool {
  type: "function";
  function: { name: string; description?: string; parameters?: JSONSchema };
}

export type ToolChoice = "none" | "auto" | "required" | { type: "function"; function: { name: string } };

/** Sampling parameters, as the server's `params` object takes them. */
export interface SamplingParams {
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  top_k?: number;
  min_p?: number;
  seed?: number;
  n?: number;
  stop?: string | string[];
  stop_token_ids?: number[];
  presence_penalty?: number;
  frequency_penalty?: number;
  repetition_penalty?: number;
  logit_bias?: Record<string, number>;
  min_tokens?: number;
  ignore_eos?: boolean;
  logprobs?: number;
  skip_special_tokens?: boolean;
  /** constrain the output (see docs/protocol.md) */
  response_format?: ResponseFormat;
  /** chat only: functions the model may call */
  tools?: Tool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
  /** chat only: variables for the model's chat template (null, booleans, numbers, strings) */
  chat_template_kwargs?: Record<string, string | number | boolean | null>;
  /** chat only: `chat_template_kwargs.enable_thinking` (Qwen3-style templates) */
  enable_thinking?: boolean;
  /** chat only: accepted and ignored */
  reasoning_effort?: "none" | "minimal" | "low" | "medium" | "high" | "xhigh";
  /** chat only: a sample still thinking after this many tokens ends there ("length") */
  max_reasoning_tokens?: number;
}

export interface RequestOptions extends SamplingParams {
  /** chosen by the client; default: generated */
  requestId?: string;
  /** aborting cancels the request; the stream then ends with a cancelled done event */
  signal?: AbortSignal;
}

export interface ChatRequest extends RequestOptions {
  messages: Message[];
}

export interface CompletionRequest extends RequestOptions {
  prompt: string | number[];
}

export interface Completion {
  id: string;
  text: string;
  texts: string[];
  /** a thinking model's reasoning ("" when it thought nothing): `text` is the answer */
  reasoning: string;
  reasonings: string[];
  tokenIds: number[][];
  status: DoneEvent["status"];
  finishReason: DoneEvent["finish_reason"];
  usage: Usage;
  timings: Timings;
  cachedTokens: CachedTokens;
  /** with tools: the calls, whole */
  toolCalls?: ToolCall[];
  /** with tools: the text outside the calls */
  content?: DoneEvent["content"];
}

export interface WarmResult {
  prompt_tokens: number;
  cached_tokens: number;
  reused_tokens: CachedTokens;
}

export declare class Stream implements AsyncIterable<StreamEvent> {
  readonly id: string;
  start: StartEvent | null;
  done: DoneEvent | null;
  /** seq of the newest delta received (where a resume after a drop picks up) */
  lastSeq: number;
  /** every token id received so far (a resume on another server continues from them) */
  receivedTokenIds: number[];
  [Symbol.asyncIterator](): AsyncIterator<StreamEvent>;
  nextEvent(): Promise<StreamEvent | null>;
  textStream(): AsyncGenerator<string>;
  final(): Promise<Completion>;
  cancel(): void;
  close(): void;
}

export interface ClientOptions {
  /** ws://host:port/v1/ws */
  url: string;
  apiKey?: string;
  protocol?: "json" | "msgpack";
  /** per event of a stream (and per warm/ping reply) */
  timeoutMs?: number;
  maxRetries?: number;
  /** resume streams in flight after the connection drops (default true) */
  resume?: boolean;
  /** routing key for a load balancer (`affinity` query parameter, and the
   * `X-Tidewire-Affinity` header where the WebSocket class can set one); default: random
   * per client */
  affinity?: string;
}

export declare class TidewireClient {
  constructor(options: ClientOptions);
  /** the routing key sent on connect */
  affinity: string;
  /** route later connections by `key`; reopens an idle socket under it now */
  setAffinity(key: string): Promise<void>;
  readonly connected: boolean;
  ready: Record<string, unknown> | null;
  chat: {
    stream(request: ChatRequest): Promise<Stream>;
    create(request: ChatRequest): Promise<Completion>;
  };
  completions: {
    stream(request: CompletionRequest): Promise<Stream>;
    create(request: CompletionRequest): Promise<Completion>;
  };
  connect(): Promise<void>;
  warm(request: { messages?: Message[]; prompt?: string | number[] }): Promise<WarmResult>;
  ping(): Promise<number>;
  close(): void;
}

export default TidewireClient;

export declare class TidewireError extends Error {}
export declare class APIError extends TidewireError {
  code: string;
  retryable: boolean;
  requestId?: string;
  /** Seconds until the same request may succeed (`rate_limited`). */
  retryAfter?: number;
  constructor(code: string, message: string, retryable?: boolean, requestId?: string,
              retryAfter?: number);
}
export declare class AuthenticationError extends APIError {}
export declare class BadRequestError extends APIError {}
export declare class NotFoundError extends BadRequestError {}
export declare class RateLimitError extends APIError {}
export declare class OverloadedError extends RateLimitError {}
export declare class SlowConsumerError extends APIError {}
export declare class InternalServerError extends APIError {}
export declare class APIConnectionError extends TidewireError {}
export declare class APITimeoutError extends APIConnectionError {}
export declare function errorFromFrame(frame: {
  id?: string;
  code: string;
  message?: string;
  retryable?: boolean;
  retry_after?: number;
}): APIError;

/** Options of streamChat / streamCompletion: the request's fields, plus these. */
export interface ResumableOptions {
  apiKey?: string;
  /** reconnects after drops before APIConnectionError (default 10) */
  maxReconnects?: number;
  /** the fetch to use (default: the global one) */
  fetch?: typeof fetch;
  /** aborting it ends the iteration quietly */
  signal?: AbortSignal;
  [field: string]: unknown;
}

/** A streamed chat completion over HTTP, resumed across dropped connections
 * (Last-Event-ID); yields OpenAI's chunk objects. */
export function streamChat(baseUrl: string, messages: Message[],
                           options?: ResumableOptions): AsyncGenerator<Record<string, any>>;
/** The same for a text completion. */
export function streamCompletion(baseUrl: string, prompt: string | number[],
                                 options?: ResumableOptions): AsyncGenerator<Record<string, any>>;
