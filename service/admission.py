"""One socket's generates on their way in: room on the socket, then admission now, or,
when the request's constraint must compile (on the engine's grammar workers) or its
prompt is large (tokenized off the loop), once that is done (`preparing`). A request
being prepared is held in flight for its key (Gateway.hold) from the start."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

from service import tools as tool_calls
from service.delivery import Live, Timings
from service.gateway import Admission, Hold
from service.protocol import Generate, ProtocolError, Resume, parse_generate

if TYPE_CHECKING:
    from service.session import Session


class Admitter:
    """Admits a socket's generates (and the resumes continued as new requests)."""

    def __init__(self, session: Session) -> None:
        self.session, self.gw, self.engine = session, session.gw, session.gw.engine
        # generates prepared before admission (a constraint compiling, a large prompt
        # tokenizing off the loop), by client id: they count as in flight
        self.preparing: dict[str, asyncio.Task[None]] = {}

    def check_room(self, rid: str) -> None:
        """A new (or resumed) stream needs a free id and room on this socket."""
        live = self.session.streams.live
        if rid in live or rid in self.preparing:
            raise ProtocolError("duplicate_id", f"request {rid!r} is already in flight", rid)
        if len(live) + len(self.preparing) >= self.session.limits.max_inflight_per_connection:
            raise ProtocolError("too_many_inflight", "too many requests in flight on this socket",
                                rid)

    def generate(self, msg: dict[str, Any]) -> None:
        g = parse_generate(msg, self.gw.sampling_defaults)
        self.check_room(g.id)
        self.admit(g)

    def admit(self, g: Generate, cont: Resume | None = None) -> None:
        """Start a generate now, or once it is prepared: the socket goes on reading
        meanwhile (see the module docstring). `cont`: see `_start`."""
        # the model's own tool-call format (its chat template's), for new and resumed ones
        g.tools = tool_calls.for_model(g.tools, getattr(self.engine, "tokenizer", None))
        gw = self.gw
        if g.messages is not None:  # a chat's reasoning budget, for the engine to enforce
            g.params = gw.think.engine_params(g.params, g.think)
        constrained = g.params.response_format is not None
        off_loop = gw.off_loop(g.prompt, g.messages)
        if not constrained and not off_loop:
            self._start(g, cont)
            return
        # held before its compile starts: a key past its compile limit starts none (one
        # that waits for a compile already under way or done adds none)
        hold = gw.hold(self.session.principal, g.id, compiling=constrained
                       and not self.engine.format_started(g.params))
        try:
            try:
                ready = self.engine.format_ready(g.params)  # (starts nothing)
            except ValueError as e:
                raise ProtocolError("invalid_request", str(e), g.id) from None
            if ready:
                gw.compiled(hold)
            if ready and not off_loop:
                self._start(g, cont, hold=hold)
                return
            task = asyncio.create_task(self._prepare(g, hold, cont))
        except BaseException:
            gw.unhold(hold)  # (a no-op once admitted)
            raise
        self.preparing[g.id] = task
        task.add_done_callback(partial(self._prepared, g.id, hold))

    def _prepared(self, rid: str, hold: Hold, task: asyncio.Task[None]) -> None:
        if self.preparing.get(rid) is task:
            del self.preparing[rid]
        self.gw.unhold(hold)  # (a task cancelled before it ran never reached its finally)

    async def _prepare(self, g: Generate, hold: Hold, cont: Resume | None) -> None:
        s, gw = self.session, self.gw
        try:
            try:
                await self.engine.prepare(g.params)
            except ValueError as e:
                raise ProtocolError("invalid_request", str(e), g.id) from None
            gw.compiled(hold)
            messages, template_tools = self._render(g)
            ids = None
            if gw.off_loop(g.prompt, messages):
                ids = await gw.prompt_ids(g.prompt, messages, g.id, True, template_tools,
                                          self._template_kwargs(g))
            s.check_open()
            self.preparing.pop(g.id, None)  # (its room is the live stream's now)
            self._start(g, cont, ids, hold)
        except ProtocolError as e:
            s.error(e)
        except Exception as e:  # noqa: BLE001 - this request's fault: answered, not leaked
            s.internal(e, {"id": g.id})
        finally:
            gw.unhold(hold)  # (a no-op once admitted)

    def _template_kwargs(self, g: Generate) -> dict[str, Any] | None:
        """The chat template's extra variables (a plain prompt has no template)."""
        if g.messages is None or g.think is None:
            return None
        return self.gw.think.template_kwargs(g.think, g.params.response_format is not None)

    def _render(self, g: Generate) -> tuple[Any, Any]:
        """The generate's messages with its tools rendered, and the tools the template
        takes (None, None for a plain prompt)."""
        if g.messages is None:
            return None, None
        return tool_calls.render(g.messages, g.tools,
                                 self.engine.template_renders_tools)

    def _start(self, g: Generate, cont: Resume | None = None, ids: list[int] | None = None,
               hold: Hold | None = None) -> None:
        """Admit a generate. `cont`: a resume continuing it from the tokens its client
        received (answered `resumed`; the stream goes on from `cont.after_seq`). `ids`:
        its prompt, tokenized already; `hold`: its hold (see `admit`)."""
        s, gw = self.session, self.gw
        ahead = gw.queue_position()
        messages, template_tools = self._render(g)
        adm = gw.submit(s.principal, g.params, g.id, g.prompt, messages, tools=template_tools,
                        output_token_ids=cont.token_ids if cont is not None else (),
                        prompt_ids=ids, hold=hold, template_kwargs=self._template_kwargs(g))
        try:
            self._started(g, adm, ahead, cont)
        except BaseException:  # nothing admitted may leak: the request ends here
            s.streams.live.pop(g.id, None)
            adm.stream.listener = None
            gw.end(adm)
            raise

    def _started(self, g: Generate, adm: Admission, ahead: int | None,
                 cont: Resume | None) -> None:
        s = self.session
        if cont is not None:
            self.gw.metrics.resumes.labels("continued").inc()
            s.frame({"type": "resumed", "id": g.id, "after_seq": cont.after_seq})
        if ahead is not None:
            s.frame({"type": "queued", "id": g.id, "position": ahead})
        live = Live(g.id, adm, g.params.logprobs is not None, Timings(adm.arrival), tools=g.tools)
        if g.messages is not None and g.think is not None:
            live.think = self.gw.think.request(adm.stream.output.prompt_token_ids, g.think,
                                               g.params.n, g.params.response_format is not None)
        if cont is not None:  # the client had its start and after_seq deltas
            first = live.stream.output.outputs[0]
            live.started, live.seq = True, cont.after_seq
            live.marks = [(0, len(first.token_ids), first.text_len)] * cont.after_seq
            if live.think is not None:  # and the split of their text
                said = live.think.samples[0]
                said.prime(first.text, len(first.token_ids))
                live.said = [said.said] * cont.after_seq
        s.streams.live[g.id] = live
        # No output can have arrived yet: dispatch runs on this (the loop) thread.
        live.stream.listener = partial(s.sender.notify, live)
