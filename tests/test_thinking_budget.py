"""The thinking budget (SamplingParams.thinking_budget, engine/request.py ThinkingBudget):
the state machine on its own, then the engine on a tiny random model. A sample that has
thought `budget` tokens gets the close ids in place of its next samples, one a step, and
goes on; what it writes after the close is HF transformers' greedy continuation of the
prompt + its output up to the close (so the forced ids were the model's inputs), under
chunked prefill, speculative decoding (n-gram and draft), n = 2, park / unpark and a
stream continued from its tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.request import Request, ThinkingBudget
from tests.conftest import hf_greedy, random_prompts

END = (7, 8)  # the close, as token ids
BUDGET = 5
MAX = 20
THINK = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, thinking_budget=BUDGET,
                       think_end_ids=END, thinking_open=True)


def _take(tb: ThinkingBudget, sampled: list[int], output: list[int] | None = None) -> list[int]:
    """The output after each of `sampled` goes through take()."""
    output = [] if output is None else output
    for t in sampled:
        output.append(tb.take(output, t))
    return output


def _budget(budget: int = 3, end: tuple[int, ...] = END, prompt: tuple[int, ...] = (1, 2),
            **kw) -> ThinkingBudget:
    return ThinkingBudget(SamplingParams(thinking_budget=budget, think_end_ids=end, **kw),
                          list(prompt))


# -- the state machine -----------------------------------------------------------------------

def test_the_budget_forces_the_close_then_lets_the_sample_go_on() -> None:
    tb = _budget(3, end=(7, 8, 9), thinking_open=True)
    out = _take(tb, [50, 51, 52, 53, 54, 55, 56])
    assert out == [50, 51, 52, 7, 8, 9, 56]
    assert tb.spent == 3 and tb.closing == -1 and not tb.forced
    assert _take(tb, [50] * 10, out)[7:] == [50] * 10  # closed: never forced again


def test_a_close_the_model_writes_itself_ends_the_thinking() -> None:
    tb = _budget(4, thinking_open=True)
    assert _take(tb, [50, 7, 8, 51, 52, 53, 54]) == [50, 7, 8, 51, 52, 53, 54]
    # its last thinking token closes it: not forced
    tb = _budget(3, thinking_open=True)
    assert _take(tb, [50, 7, 8, 51]) == [50, 7, 8, 51]


def test_a_close_begun_by_the_model_is_completed() -> None:
    tb = _budget(3, end=(7, 8, 9), thinking_open=True)
    assert _take(tb, [50, 7, 7, 60, 61, 62]) == [50, 7, 7, 8, 9, 62]  # its 7 begins the close
    tb = _budget(3, end=(7, 8, 9), thinking_open=True)
    assert _take(tb, [50, 7, 8, 60, 61]) == [50, 7, 8, 9, 61]


def test_budget_zero_forces_from_the_first_token() -> None:
    assert _take(_budget(0, thinking_open=True), [50, 51, 52]) == [7, 8, 52]


def test_where_the_thinking_opens() -> None:
    # closed from the start: nothing counts
    assert _take(_budget(1), [50, 51, 52]) == [50, 51, 52]
    # the prompt ends with the start ids
    assert _take(_budget(1, prompt=(1, 4, 5), think_start_ids=(4, 5)), [50, 51, 52]) == [
        50, 7, 8]
    # the output begins with them: they do not count
    tb = _budget(2, think_start_ids=(4, 5))
    assert _take(tb, [4, 5, 50, 51, 52, 53]) == [4, 5, 50, 51, 7, 8]
    # anywhere else they open nothing
    assert _take(_budget(1, think_start_ids=(4, 5)), [50, 4, 5, 51, 52]) == [50, 4, 5, 51, 52]
    assert _take(_budget(0, think_start_ids=(4, 5)), [4, 5, 50, 51]) == [4, 5, 7, 8]


def test_a_continued_output_rebuilds_the_state() -> None:
    """Tokens it never took (a stream continued from its client's tokens) are replayed,
    wherever they stop: the next token is what one uninterrupted run appends."""
    sampled = [4, 5, 50, 51, 52, 53, 54, 55]
    whole = _take(_budget(2, think_start_ids=(4, 5)), sampled)
    for cut in range(len(sampled)):
        tb = _budget(2, think_start_ids=(4, 5))
        assert _take(tb, sampled[cut:], whole[:cut]) == whole, cut


def test_the_params_are_checked() -> None:
    with pytest.raises(ValueError, match="think_end_ids"):
        SamplingParams(thinking_budget=3)
    with pytest.raises(ValueError, match="thinking_budget must be an integer"):
        SamplingParams(thinking_budget=-1, think_end_ids=END)
    with pytest.raises(ValueError, match="response_format"):
        SamplingParams(thinking_budget=3, think_end_ids=END, response_format={"type": "json"})
    with pytest.raises(ValueError, match="think_start_ids takes at most"):
        SamplingParams(think_start_ids=[1] * 65)
    with pytest.raises(ValueError, match="thinking_open must be a boolean"):
        SamplingParams(thinking_open=1)
    p = SamplingParams(thinking_budget=3, think_end_ids=[7, 8], think_start_ids=[4])
    assert (p.think_end_ids, p.think_start_ids) == ((7, 8), (4,))
    # a request without a budget carries no state
    assert Request("r", [1, 2], SamplingParams()).thinking is None
    assert Request("r", [1, 2], p).thinking is not None


# -- the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models("llama", 0)


def _prompts(n: int = 3, lo: int = 20, hi: int = 40, seed: int = 41) -> list[list[int]]:
    return random_prompts(n, lo, hi, 320, seed=seed)


def _check(path, prompt: list[int], out: list[int], params: SamplingParams = THINK,
           at: int = 0) -> None:
    """`out` thought `budget` tokens (from `at`: where the thinking opened) that were
    the model's own greedy ones, then has the close, then the model's greedy
    continuation of everything before: the close was its input."""
    close = at + params.thinking_budget  # type: ignore[operator]
    end = close + len(params.think_end_ids)
    assert len(out) == params.max_tokens
    assert out[:close] == hf_greedy(path, [prompt], close)[0]
    assert tuple(out[close:end]) == params.think_end_ids
    assert out[end:] == hf_greedy(path, [prompt + out[:end]], params.max_tokens - end)[0]


def _clean(llm: LLM) -> None:
    eng = llm.engine
    assert eng.kv.num_free_blocks == eng.num_blocks, "blocks leaked"
    assert not eng.scheduler.requests


@pytest.mark.parametrize("regime", [{}, {"max_num_batched_tokens": 16},
                                    {"block_size": 4, "num_kv_blocks": 40,
                                     "max_num_batched_tokens": 64}],
                         ids=["one-big-batch", "chunked-prefill", "preemption"])
def test_the_engine_forces_the_close_and_the_model_reads_it(path, regime: dict) -> None:
    prompts = _prompts(4 if regime.get("num_kv_blocks") else 3)
    llm = LLM(model=str(path), dtype="float32", debug=True, **regime)
    got = llm.generate(prompts, THINK)
    for p, g in zip(prompts, got):
        _check(path, p, g.token_ids)
        assert g.finish_reason == "length"
    # the forcing changed what came next (it would be the same run without it)
    plain = hf_greedy(path, prompts, MAX)
    assert any(g.token_ids[BUDGET:] != w[BUDGET:] for g, w in zip(got, plain))
    if regime.get("num_kv_blocks"):
        assert llm.engine.scheduler.num_preemptions > 0
    _clean(llm)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=str(path), dtype="float32", debug=True)


def test_the_thinking_opens_in_the_prompt_or_the_output(path, llm) -> None:
    prompt = _prompts(1)[0]
    greedy = hf_greedy(path, [prompt], MAX)[0]
    # the prompt ends with the start ids (and thinking_open is not set)
    p = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, thinking_budget=4,
                       think_end_ids=END, think_start_ids=tuple(prompt[-2:]))
    _check(path, prompt, llm.generate([prompt], p)[0].token_ids, p)
    # the output begins with them: the budget counts from there
    p = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, thinking_budget=4,
                       think_end_ids=END, think_start_ids=tuple(greedy[:2]))
    _check(path, prompt, llm.generate([prompt], p)[0].token_ids, p, at=2)
    # nothing opens: the output is the plain greedy one
    p = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, thinking_budget=1,
                       think_end_ids=END, think_start_ids=(greedy[0] + 1,))
    assert llm.generate([prompt], p)[0].token_ids == greedy


def test_a_close_the_model_writes_within_the_budget_forces_nothing(path, llm) -> None:
    prompt = _prompts(1, seed=43)[0]
    greedy = hf_greedy(path, [prompt], MAX)[0]
    end = (greedy[2], greedy[3])
    first = next(i for i in range(1, MAX) if (greedy[i - 1], greedy[i]) == end)
    p = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, thinking_budget=first + 1,
                       think_end_ids=end, thinking_open=True)
    assert llm.generate([prompt], p)[0].token_ids == greedy


def test_stop_max_tokens_and_logprobs_with_a_forced_close(path, llm) -> None:
    prompt = _prompts(1, seed=46)[0]
    whole = llm.generate([prompt], THINK)[0].token_ids
    assert END[1] not in whole[:BUDGET]  # (it could stop there by itself)
    # max_tokens ends it inside the close
    cut = SamplingParams(**{**_fields(THINK), "max_tokens": BUDGET + 1})
    out = llm.generate([prompt], cut)[0]
    assert (out.token_ids, out.finish_reason) == (whole[:BUDGET + 1], "length")
    # a stop token that is a forced id ends it there
    stop = SamplingParams(**{**_fields(THINK), "stop_token_ids": [END[1]]})
    out = llm.generate([prompt], stop)[0]
    assert (out.token_ids, out.finish_reason, out.outputs[0].stop_reason) == (
        whole[:BUDGET + 2], "stop", END[1])
    # logprobs: the sampled tokens' own, the forced ones' those of the forcing
    lp = SamplingParams(**{**_fields(THINK), "logprobs": 2})
    out = llm.generate([prompt], lp)[0]
    assert out.token_ids == whole
    lps = out.outputs[0].logprobs
    assert [x.token_id for x in lps] == whole
    assert [(x.logprob, x.top) for x in lps[BUDGET:BUDGET + 2]] == [(0.0, [(t, 0.0)]) for t in END]
    assert all(x.logprob < 0 and len(x.top) == 2 for x in lps[:BUDGET] + lps[BUDGET + 2:])


def _fields(p: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(p, f.name) for f in fields(p)}


def test_each_of_n_samples_has_its_own_budget(path, llm) -> None:
    prompt = _prompts(1)[0]
    out = llm.generate([prompt], SamplingParams(**{**_fields(THINK), "n": 2}))[0]
    for o in out.outputs:
        _check(path, prompt, o.token_ids)
    sampled = SamplingParams(**{**_fields(THINK), "n": 2, "temperature": 1.0, "seed": 5,
                                "thinking_budget": 3})
    outs = llm.generate([prompt], sampled)[0].outputs
    assert outs[0].token_ids[:3] != outs[1].token_ids[:3]  # they think apart...
    for o in outs:  # ...and each is closed after its own 3
        assert tuple(o.token_ids[3:5]) == END and len(o.token_ids) == MAX


def _drive(llm: LLM, reqs, park_at: int | None = None, hold: int = 2) -> dict[str, list[int]]:
    """Step to completion, parking every request after `park_at` steps for `hold`."""
    eng = llm.engine
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.add(r)
    steps = 0
    while eng.has_unfinished() or eng.scheduler.parked:
        if steps == park_at:
            assert eng.park(list(toks)) == len(toks)
        if park_at is not None and steps == park_at + hold:
            assert eng.unpark(list(toks)) == len(toks)
        for out in eng.step():
            toks[out.request_id] += out.new_token_ids
        steps += 1
    return toks


def test_park_unpark_and_a_continued_stream_keep_the_close(path) -> None:
    """Parked inside the close (one forced id out, one to go), the requests recompute
    from their tokens and go on exactly; so does a stream continued elsewhere from the
    tokens its client had, wherever they stop."""
    prompts = _prompts(2, seed=44)
    llm = LLM(model=str(path), dtype="float32", debug=True, block_size=4)
    eng = llm.engine
    reqs = [eng.make_request(p, THINK, f"r{i}") for i, p in enumerate(prompts)]
    got = _drive(llm, reqs, park_at=BUDGET + 1)  # (step 1 is the prefill's token)
    assert [r.thinking.spent for r in reqs] == [BUDGET, BUDGET]  # type: ignore[union-attr]
    for i, p in enumerate(prompts):
        _check(path, p, got[f"r{i}"])
    for cut in (BUDGET - 1, BUDGET + 1, BUDGET + 2):
        have = got["r0"][:cut]
        more = _drive(llm, [eng.make_request(prompts[0], THINK, f"c{cut}", output_token_ids=have)])
        assert have + more[f"c{cut}"] == got["r0"], cut
    _clean(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_forced_close(path, method: str) -> None:
    """The draft is the target itself (every proposal accepted), so the budget is spent
    inside a step's accepted run: the forced id ends it. Logprobs stay aligned."""
    extra = {"draft_model": str(path)} if method == "draft" else {}
    llm = LLM(model=str(path), dtype="float32", debug=True, speculative=method,
              num_speculative_tokens=3, speculative_min_acceptance=0.0, **extra)
    loops = [p[:6] * 5 for p in _prompts(2, seed=45)]  # prompt lookup finds these
    prompts = _prompts(2) + loops
    params = SamplingParams(**{**_fields(THINK), "logprobs": 0})
    got = llm.generate(prompts, params)
    for p, g in zip(prompts, got):
        _check(path, p, g.token_ids)
        assert [x.token_id for x in g.outputs[0].logprobs] == g.token_ids
    steps, proposed, accepted = (sum(x) for x in zip(*[g.spec for g in got if g.spec]))
    assert steps > 0 and accepted > 0
    _clean(llm)


def test_the_bounds_at_their_extremes() -> None:
    """The largest budget and the longest id lists are taken; one past is refused (the
    service's max_reasoning_tokens has the same ceiling: tests/test_reasoning.py)."""
    from engine.sampling_params import MAX_TOKENS

    p = SamplingParams(thinking_budget=MAX_TOKENS, think_end_ids=[7] * 64,
                       think_start_ids=[4] * 64)
    assert p.thinking_budget == MAX_TOKENS and len(p.think_end_ids) == 64
    with pytest.raises(ValueError, match="thinking_budget must be an integer"):
        SamplingParams(thinking_budget=MAX_TOKENS + 1, think_end_ids=END)
    with pytest.raises(ValueError, match="think_end_ids takes at most"):
        SamplingParams(thinking_budget=3, think_end_ids=[7] * 65)
