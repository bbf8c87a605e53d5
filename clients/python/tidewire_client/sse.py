"""Tidewire's OpenAI-compatible HTTP streams that survive a dropped connection.

`stream_chat(base_url, messages, **params)` (and `stream_completion(base_url, prompt,
**params)`) POST a streamed completion that opts in to resuming (`X-Tidewire-Resume: 1`)
and yield its chunks (OpenAI's `chat.completion.chunk` objects, as dicts). When the
connection drops before `[DONE]`, they reconnect to `GET {base}/chat/completions/{id}/
events` with the last event's id as `Last-Event-ID`, and the stream goes on where it was:
on the same server (it kept running), or, behind a balancer, on another replica sharing
the Redis tier (it continues the request from the tokens received). The text is the
uninterrupted stream's. Only the standard library is used (a blocking iterator)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any, Optional
from urllib.parse import urlsplit

from tidewire_client._errors import APIConnectionError, APIError, error_from_frame

# what a dropped connection raises while a response is read
_DROPPED = (OSError, http.client.HTTPException)


def stream_chat(base_url: str, messages: list[dict[str, Any]], *, api_key: Optional[str] = None,
                max_reconnects: int = 10, timeout: float = 60.0,
                **params: Any) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed chat completion (`params`: the request's other fields,
    e.g. max_tokens, temperature, seed), resumed across dropped connections."""
    body = {**params, "messages": messages, "stream": True}
    return _Resumable(base_url, "chat/completions", body, api_key, max_reconnects,
                      timeout).chunks()


def stream_completion(base_url: str, prompt: Any, *, api_key: Optional[str] = None,
                      max_reconnects: int = 10, timeout: float = 60.0,
                      **params: Any) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed text completion, resumed across dropped connections."""
    body = {**params, "prompt": prompt, "stream": True}
    return _Resumable(base_url, "completions", body, api_key, max_reconnects,
                      timeout).chunks()


class _Resumable:
    def __init__(self, base_url: str, path: str, body: dict[str, Any], api_key: Optional[str],
                 max_reconnects: int, timeout: float) -> None:
        u = urlsplit(base_url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base_url must be http(s)://host[:port]/v1, not {base_url!r}")
        self.https, self.host, self.port = u.scheme == "https", u.hostname, u.port
        self.prefix, self.path, self.body = u.path, path, body
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                        "X-Tidewire-Resume": "1"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.max_reconnects, self.timeout = max_reconnects, timeout
        self.stream_id: Optional[str] = None  # the completion's id, from its first chunk
        self.last_event_id: Optional[str] = None
        self.reconnects = 0  # how many times the stream was picked up again
        self.retry = 0.5  # seconds before a reconnect (the server's `retry:` says)

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def chunks(self) -> Iterator[dict[str, Any]]:
        conn = self._connection()
        try:
            conn.request("POST", f"{self.prefix}/{self.path}", json.dumps(self.body),
                         self.headers)
            response = conn.getresponse()
        except _DROPPED as e:
            conn.close()
            raise APIConnectionError(f"the request could not be sent: {e!r}") from e
        finished = False
        try:
            while True:
                try:
                    if response.status != 200:
                        finished = True
                        raise _error(response)
                    for chunk in self._events(response):
                        if chunk is None:
                            finished = True
                            return
                        yield chunk
                    raise ConnectionResetError("the stream ended before [DONE]")
                except _DROPPED as e:
                    conn.close()
                    conn, response = self._reconnect(e)
        finally:
            conn.close()
            if not finished and self.stream_id is not None:
                self._cancel()

    def _cancel(self) -> None:
        """Left before its end (the caller stopped iterating, or gave up): the server
        would run the stream on for its grace; say it is not wanted (best effort)."""
        conn = self._connection()
        conn.timeout = min(self.timeout, 5.0)
        try:
            conn.request("DELETE", f"{self.prefix}/{self.path}/{self.stream_id}/events",
                         headers=self.headers)
            conn.getresponse().read()
        except _DROPPED:
            pass
        finally:
            conn.close()

    def _reconnect(self, cause: BaseException) -> tuple[http.client.HTTPConnection,
                                                        http.client.HTTPResponse]:
        if self.stream_id is None or self.last_event_id is None:
            raise APIConnectionError(f"the stream dropped before its first event: {cause!r}")
        while True:
            if self.reconnects >= self.max_reconnects:
                raise APIConnectionError(f"the stream dropped {self.reconnects} times; "
                                         f"giving up: {cause!r}")
            self.reconnects += 1
            time.sleep(self.retry)
            conn = self._connection()
            try:
                conn.request("GET", f"{self.prefix}/{self.path}/{self.stream_id}/events",
                             headers={**self.headers, "Last-Event-ID": self.last_event_id})
                return conn, conn.getresponse()
            except _DROPPED as e:
                conn.close()
                cause = e

    def _events(self, response: http.client.HTTPResponse) -> Iterator[Optional[dict[str, Any]]]:
        """Each event's chunk; None at [DONE]."""
        data, event_id = None, None
        while True:
            raw = response.readline()
            if not raw:
                return
            line = raw.decode("utf-8").rstrip("\r\n")
            if line:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data":
                    data = value
                elif name == "id":
                    event_id = value
                elif name == "retry" and value.isdigit():
                    self.retry = int(value) / 1000
                continue
            if data is None:
                continue
            if event_id is not None:
                self.last_event_id = event_id
            if data == "[DONE]":
                yield None
                return
            chunk = json.loads(data)
            if "error" in chunk and "choices" not in chunk:
                raise error_from_frame({**chunk["error"], "code": chunk["error"].get("code")})
            self.stream_id = self.stream_id or chunk.get("id")
            data, event_id = None, None
            yield chunk


def _error(response: http.client.HTTPResponse) -> APIError:
    """The exception for a non-200 answer (OpenAI's error body)."""
    try:
        err = json.loads(response.read()).get("error") or {}
    except ValueError:
        err = {}
    return error_from_frame({"code": err.get("code") or f"http_{response.status}",
                             "message": err.get("message") or response.reason})
