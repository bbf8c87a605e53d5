"""Prepare: compile a request's response_format before the request is added.

The loop waits here (asyncio) for the engine's grammar workers (GrammarCompiler) while
the engine thread keeps stepping, so that a bad or too costly constraint is refused
before the request takes a batch slot. AsyncEngine's `prepare`, `format_ready` and
`format_started` are these functions over the loaded engine's compiler.
"""

from __future__ import annotations

import asyncio

from engine.sampling_params import SamplingParams
from engine.structured import GrammarCompiler, GrammarError


def format_ready(grammars: GrammarCompiler | None, params: SamplingParams) -> bool:
    """Whether the request can be added without waiting for a compile: it is
    unconstrained, or its constraint has compiled. Raises ValueError when that
    compile failed. (Starts nothing: `prepare` compiles.)"""
    fmt = params.response_format
    if fmt is None:
        return True
    if grammars is None:
        raise ValueError("response_format needs a model with a tokenizer")
    fut = grammars.peek(fmt)
    if fut is None or not fut.done() or fut.cancelled():
        return False
    fut.result()
    return True


def format_started(grammars: GrammarCompiler | None, params: SamplingParams) -> bool:
    """Whether the request's constraint is compiled or compiling already (a request
    that waits for it starts no compile of its own)."""
    fmt = params.response_format
    fut = grammars.peek(fmt) if fmt is not None and grammars is not None else None
    return fut is not None and not fut.cancelled()


async def prepare(grammars: GrammarCompiler | None, params: SamplingParams) -> None:
    """Compile the request's response_format on the grammar workers (a no-op when it
    is unconstrained or already compiled), so that a bad constraint is refused before
    the request is added; raises ValueError naming the problem. A wait that times out
    or is cancelled (the client left) stops waiting for the compile: one nobody waits
    for any more is cancelled if it has not started (GrammarCompiler.release)."""
    fmt = params.response_format
    if fmt is None:
        return
    if grammars is None:
        raise ValueError("response_format needs a model with a tokenizer")
    fut = grammars.submit(fmt)
    if fut.done():
        fut.result()
        return
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), grammars.timeout)
    except asyncio.TimeoutError:
        grammars.release(fmt)
        raise GrammarError(f"the {fmt.kind} constraint took over {grammars.timeout:g}s "
                           "to compile; simplify it") from None
    except asyncio.CancelledError:
        grammars.release(fmt)
        task = asyncio.current_task()
        if fut.cancelled() and not (task is not None and task.cancelling()):
            raise GrammarError(f"the {fmt.kind} constraint's compile was cancelled; "
                               "send the request again") from None
        raise
