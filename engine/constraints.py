"""A constrained sample's life in the engine (torch-free): waiting, out of the batch, for
its response_format to compile (CompileQueue), then its matcher fed each step's tokens.
The compiles themselves run on GrammarCompiler's workers (engine/structured.py)."""

from __future__ import annotations

import logging
from concurrent import futures

from engine.request import Request, RequestStatus
from engine.structured import GrammarCompiler

log = logging.getLogger("tidewire.engine")


class CompileQueue:
    """Added samples whose constraint is still compiling; the batch keeps going meanwhile."""

    def __init__(self, grammars: GrammarCompiler | None) -> None:
        self.grammars = grammars
        self._waiting: list[Request] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __contains__(self, r: Request) -> bool:
        return r in self._waiting

    def add(self, r: Request) -> None:
        self._waiting.append(r)

    def take_done(self) -> list[tuple[Request, bool]]:
        """Take the samples whose compile is over, in the order they came, each with
        whether it compiled. A failed compile (it raised, or was cancelled) is logged,
        and released as remove() does."""
        done, still = [], []
        for r in self._waiting:
            if not r.grammar.done():
                still.append(r)
            elif not r.grammar.cancelled() and r.grammar.exception() is None:
                done.append((r, True))
            else:
                why = ("its compile was cancelled" if r.grammar.cancelled()
                       else r.grammar.exception())
                log.warning("request %s: %s", r.parent_id, why)
                self._release(r)
                done.append((r, False))
        self._waiting = still
        return done

    def remove(self, parent_id: str) -> list[Request]:
        """Take a request's waiting samples out; a compile nobody waits for any more is
        cancelled if it has not started (GrammarCompiler.release: make_request's waiter)."""
        taken = [r for r in self._waiting if r.parent_id == parent_id]
        if taken:
            self._waiting = [r for r in self._waiting if r.parent_id != parent_id]
            self._release(taken[0])
        return taken

    def _release(self, r: Request) -> None:
        fmt = r.params.response_format
        if self.grammars is not None and fmt is not None:
            self.grammars.release(fmt)

    def wait(self, timeout: float) -> None:
        """Only compiles are pending: wait a little for one."""
        futures.wait([r.grammar for r in self._waiting], timeout, futures.FIRST_COMPLETED)


def attach_matcher(r: Request, grammars: GrammarCompiler) -> bool:
    """Give a compiled sample its matcher, fed the tokens a continued request has so
    far; False when they break the constraint."""
    r.matcher = grammars.matcher(r.grammar.result())
    return all(r.matcher.accept(t) for t in r.output_token_ids)


def advance_matcher(r: Request) -> RequestStatus | None:
    """Feed a constrained sample's new tokens to its matcher. One that reached the
    constraint's end (accepted a stop token) ends there (tokens after that point,
    proposals accepted past it, are dropped). Returns the status the sample ends with
    when it must be ended (or, already finished, re-marked): FINISHED_ERROR for a token
    that broke the constraint, FINISHED_STOPPED for a running one the constraint ended."""
    m = r.matcher
    new = r.output_token_ids[-r.num_new_tokens_last:]
    for j, t in enumerate(new):
        if not m.accept(t):  # only when the constraint allowed nothing
            log.error("request %s: token %d broke its constraint", r.parent_id, t)
            r.drop_last(len(new) - j - 1)
            return RequestStatus.FINISHED_ERROR  # (a stop token that ended it: still this)
        if m.terminated:
            r.drop_last(len(new) - j - 1)
            # ignore_eos: the constraint ends it
            return None if r.status.finished else RequestStatus.FINISHED_STOPPED
    return None
