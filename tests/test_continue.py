"""A request continued from the tokens it had produced (a stream resumed on a replica
that never saw it): recomputed with its prompt, it goes on exactly as the uninterrupted
run would, greedy (against HF) and seeded sampling with penalties alike, in a mixed
batch with preemption; one whose tokens already end it finishes at once."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import hf_greedy, random_prompts


def run(eng: LLMEngine, reqs: list[tuple[list[int], SamplingParams, list[int]]]
        ) -> list[tuple[list[int], str | None]]:
    """Each (prompt, params, tokens so far) at once: (new tokens, finish reason)."""
    got: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    def take(o) -> None:  # noqa: ANN001 - a StepOutput
        got[o.request_id] += o.new_token_ids
        if o.finished:
            reasons[o.request_id] = o.finish_reason

    for i, (p, sp, done) in enumerate(reqs):
        got[f"c{i}"] = []
        for o in eng.add(eng.make_request(p, sp, f"c{i}", output_token_ids=done)):
            take(o)
    while eng.has_unfinished():
        for o in eng.step():
            take(o)
    assert eng.kv.num_free_blocks == eng.num_blocks
    return [(got[f"c{i}"], reasons[f"c{i}"]) for i in range(len(reqs))]


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("regime", [{}, dict(block_size=4, num_kv_blocks=40,
                                             max_num_batched_tokens=32)],
                         ids=["batch", "preemption"])
def test_greedy_continues_exactly_where_it_stopped(tiny_models, regime: dict) -> None:
    path = tiny_models("llama", 0)
    prompts = random_prompts(6, 5, 40, 320, seed=4)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(model=str(path), dtype="float32", debug=True, **regime)
    cuts = [1, 3, 7, 15, 0, 16]  # 0: an ordinary request alongside; 16: already done
    got = run(llm.engine, [(p, GREEDY, r[:k]) for p, r, k in zip(prompts, ref, cuts)])
    for (new, reason), r, k in zip(got, ref, cuts):
        assert new == r[k:]
        assert reason == "length"
    if regime:
        assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_with_penalties_continues_identically(tiny_models) -> None:
    path = tiny_models("llama", 1)
    llm = LLM(model=str(path), dtype="float32", debug=True)
    prompts = random_prompts(4, 8, 30, 320, seed=5)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=100 + i,
                             frequency_penalty=0.7, presence_penalty=0.3,
                             repetition_penalty=1.1, ignore_eos=True) for i in range(4)]
    whole = run(llm.engine, [(p, sp, []) for p, sp in zip(prompts, params)])
    cuts = [1, 6, 13, 19]
    cont = run(llm.engine, [(p, sp, w[0][:k]) for p, sp, w, k in zip(prompts, params, whole, cuts)])
    for (new, _), (full, _), k in zip(cont, whole, cuts):
        assert new == full[k:]


def test_tokens_that_end_the_request_finish_it_at_once(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", debug=True)
    eng = llm.engine
    p = [5, 6, 7, 8]
    (new, reason), = run(eng, [(p, SamplingParams(max_tokens=3, temperature=0.0), [9, 10, 11])])
    assert (new, reason) == ([], "length")
    stop = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[42])
    (new, reason), = run(eng, [(p, stop, [9, 42])])
    assert (new, reason) == ([], "stop")


def test_continued_requests_are_validated(tiny_models) -> None:
    path = tiny_models("llama", 0)
    eng = LLM(model=str(path), dtype="float32").engine
    with pytest.raises(ValueError, match="n = 1"):
        eng.make_request([5, 6], SamplingParams(max_tokens=4, n=2), output_token_ids=[7])
    with pytest.raises(ValueError, match="more than max_tokens"):
        eng.make_request([5, 6], SamplingParams(max_tokens=2), output_token_ids=[7, 8, 9])
    with pytest.raises(ValueError, match="token ids"):
        eng.make_request([5, 6], SamplingParams(max_tokens=4), output_token_ids=[7, 320])
