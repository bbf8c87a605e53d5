"""Sampling: parameter validation, each logits transformation against HF transformers'
processors (and OpenAI's penalty definition), seeds, logprobs, n > 1, min_tokens,
logit_bias and stop tokens."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine import sampler as sampler_mod
from engine.sampling_params import MAX_TOP_K
from engine.sampler import (Sampler, SamplingBatch, apply_min_p, apply_presence_frequency,
                            apply_repetition_penalty, apply_temperature, apply_top_k_top_p,
                            sample_from)
from tests.conftest import hf_model, random_prompts


@pytest.mark.parametrize("kw,name", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed="x"), "seed"), (dict(n=0), "n"), (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(logprobs=21), "logprobs"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={5: 500}), "logit_bias"), (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_params_name_the_parameter(kw: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_params_normalized_and_unknown_keys_rejected() -> None:
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})
    p = SamplingParams.from_dict({"stop": "END", "logit_bias": {"7": -3}, "stop_token_ids": [4]})
    assert p.stop == ("END",) and p.logit_bias == {7: -3.0} and p.stop_token_ids == (4,)


# -- each transformation equals HF transformers' processor -------------------------------

@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3


def test_temperature_matches_hf(logits) -> None:
    for t in (0.3, 1.0, 1.7):
        want = TemperatureLogitsWarper(t)(None, logits.clone())
        assert torch.equal(apply_temperature(logits, torch.full((4,), t)), want)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_top_k_matches_hf(logits, k: int) -> None:
    want = TopKLogitsWarper(k)(None, logits.clone())
    got = apply_top_k_top_p(logits, torch.full((4,), k), torch.ones(4))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_hf(logits, p: float) -> None:
    want = TopPLogitsWarper(p)(None, logits.clone())
    got = apply_top_k_top_p(logits, torch.full((4,), 300), torch.full((4,), p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


@pytest.mark.parametrize("seed", range(3))
def test_top_k_top_p_over_candidates_match_hf_on_a_large_vocabulary(seed: int,
                                                                    monkeypatch) -> None:
    """With a vocabulary past the 1,024 candidates: peaked rows cut among them, flatter
    ones need 8x as many, the flattest the full sort; rows with a top-k cut within it;
    a row with neither stays as it is. Each row equals HF's top-k then top-p."""
    tiers = []
    real = sampler_mod.apply_top_k_top_p
    monkeypatch.setattr(sampler_mod, "apply_top_k_top_p",
                        lambda *a, **k: tiers.append(a[3] if len(a) > 3 else 1024) or real(*a, **k))
    sorted_rows = []
    real_sorted = sampler_mod._top_k_top_p_sorted
    monkeypatch.setattr(sampler_mod, "_top_k_top_p_sorted",
                        lambda x, *a: sorted_rows.append(len(x)) or real_sorted(x, *a))
    vocab = 20_000
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 8.0, 2.5, 0.05, 8.0, 3.0, 1.0, 8.0])[:, None]
    logits = torch.randn(8, vocab, generator=g) * scales
    ks = torch.tensor([vocab, 40, vocab, vocab, 3000, vocab, 100, vocab])
    ps = torch.tensor([0.9, 0.95, 0.95, 0.5, 0.8, 0.99, 1.0, 1.0])
    got = real(logits.clone(), ks, ps)
    for r in range(8):
        want = logits[r:r + 1].clone()
        if ks[r] < vocab:
            want = TopKLogitsWarper(int(ks[r]))(None, want)
        if ps[r] < 1:
            want = TopPLogitsWarper(float(ps[r]))(None, want)
        kept = ~torch.isinf(want)
        assert torch.equal(~torch.isinf(got[r:r + 1]), kept), r
        assert torch.equal(got[r:r + 1][kept], want[kept]), r
    # rows 2, 3 and 5 have under p of their mass in the top 1,024; row 3 even in the
    # top 8,192 (the next tier is the whole vocabulary: the sort)
    assert tiers == [8192, 65536] and sorted_rows == [1]


def test_sample_from_inverts_the_cdf_and_never_draws_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0],
                          [0.25, 0.25, 0.25, 0.25, 0.0],
                          [0.0, 0.0, 1.0, 0.0, 0.0]])
    for u, want in [(0.0, [1, 0, 2]), (0.49, [1, 1, 2]), (0.5, [3, 2, 2]),
                    (1 - 2 ** -24, [3, 3, 2])]:
        assert sample_from(probs, torch.full((3,), u)).tolist() == want, u
    # a row that sums to a little under 1 (fp32 softmax) still maps u ~ 1 to its last token
    assert sample_from(torch.tensor([[0.3, 0.6999998, 0.0]]), torch.tensor([1 - 2 ** -24])).tolist() == [1]


@pytest.mark.parametrize("m", [0.01, 0.1, 0.5])
def test_min_p_matches_hf(logits, m: float) -> None:
    want = MinPLogitsWarper(m)(None, logits.clone())
    assert torch.equal(torch.isinf(apply_min_p(logits, torch.full((4,), m))), torch.isinf(want))


@pytest.mark.parametrize("pen", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf(logits, pen: float) -> None:
    seen = [[1, 2, 2, 50], [299, 0], [7], [3, 4, 5, 6, 7, 8, 3, 3]]
    for row, ids in enumerate(seen):
        want = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([ids]), logits[row:row + 1].clone())
        got = apply_repetition_penalty(logits[row:row + 1].clone(), [ids], torch.tensor([pen]))
        assert torch.equal(got, want)
    # all rows in one call (rows of unequal length, an empty one, per-row penalties),
    # in place: each row as HF has it, the empty row untouched
    rows = [[1, 2, 2, 50], [], [0, 299, 0], [3, 4, 5, 6, 7, 8, 3, 3]]
    pens = torch.tensor([pen, 1.5, 0.9, pen])
    batch = logits.clone()
    assert apply_repetition_penalty(batch, rows, pens) is batch
    for r, ids in enumerate(rows):
        want = logits[r:r + 1].clone()
        if ids:
            want = RepetitionPenaltyLogitsProcessor(float(pens[r]))(torch.tensor([ids]), want)
        assert torch.equal(batch[r:r + 1], want), r


def test_presence_frequency_match_openai(logits) -> None:
    outputs = [[1, 1, 1, 9], [], [5, 6, 5, 0, 0, 0, 0], [299, 299]]
    pres, freq = torch.tensor([0.5, 1.0, -0.5, 2.0]), torch.tensor([0.25, 0.0, 1.5, -1.0])
    got = apply_presence_frequency(logits.clone(), outputs, pres, freq)
    want = logits.clone()
    for r, ids in enumerate(outputs):  # mu[j] - c[j] * a_freq - float(c[j] > 0) * a_pres
        for tok in set(ids):
            c = ids.count(tok)
            want[r, tok] = want[r, tok] - c * freq[r] - (1.0 if c > 0 else 0.0) * pres[r]
    assert torch.equal(got, want)  # the same float operations, in the same order


# -- the sampler ------------------------------------------------------------------------

def _batch(params: list[SamplingParams], gens=None, outputs=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, gens or [None] * n, [[]] * n, outputs or [[]] * n,
                         [frozenset()] * n)


def test_greedy_is_argmax(logits) -> None:
    out = Sampler()(logits.clone(), _batch([SamplingParams(temperature=0.0)] * 4))
    assert out.tokens == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(seed=0)
    draws = [s(logits.clone(), _batch([SamplingParams(temperature=1.0)])).tokens[0]
             for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_top_k_restricts_the_support(logits) -> None:
    top5 = set(logits[0].topk(5).indices.tolist())
    s = Sampler(seed=1)
    draws = {s(logits[:1].clone(), _batch([SamplingParams(temperature=1.0, top_k=5)])).tokens[0]
             for _ in range(300)}
    assert draws <= top5 and len(draws) > 1


def test_logit_bias_and_banned_stop_tokens_before_min_tokens(logits) -> None:
    s = Sampler()
    biased = SamplingParams(temperature=0.0, logit_bias={17: 100.0})
    assert s(logits[:1].clone(), _batch([biased])).tokens == [17]
    best = int(logits[0].argmax())
    early = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[best])
    assert s(logits[:1].clone(), _batch([early], outputs=[[1]])).tokens != [best]
    assert s(logits[:1].clone(), _batch([early], outputs=[[1, 2, 3]])).tokens == [best]


# -- end to end through the engine (tiny random model) ---------------------------------

def test_seeded_request_same_alone_or_in_any_batch(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=32)
    prompts = random_prompts(5, 5, 40, 320, seed=11)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.3, top_k=7, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.5, min_p=0.05, ignore_eos=True)]
    mixed = llm.generate([prompts[1], prompts[2], prompts[0], prompts[3], prompts[4]],
                         [others[0], others[1], seeded, others[2], others[3]])
    assert mixed[2].token_ids == alone
    # the greedy row among sampled ones takes its argmax, as it does alone
    assert mixed[1].token_ids == llm.generate([prompts[2]], others[1])[0].token_ids
    again = llm.generate([prompts[4], prompts[0]], [others[3], seeded])[1].token_ids
    assert again == alone
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=4321,
                                ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed)[0].token_ids != alone


def test_logprobs_equal_log_softmax_of_model_logits(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32")
    prompt = random_prompts(1, 12, 12, 320, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=3,
                                                logprobs=5, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 6
    with torch.inference_mode():
        full = torch.tensor([prompt + out.token_ids])
        lp = torch.log_softmax(hf_model(path)(full).logits[0].float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        row = lp[len(prompt) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        top = row.topk(5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_n_samples_share_prompt_blocks_and_differ(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", block_size=8, debug=True)
    eng: LLMEngine = llm.engine
    prompt = random_prompts(1, 43, 43, 320, seed=13)[0]  # 5 full blocks + 3 tokens
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4, ignore_eos=True)
    eng.add(eng.make_request(prompt, params, "multi"))
    refs = []
    while eng.has_unfinished():
        eng.step()
        ids = [eng.kv.block_ids(f"multi\x00{i}") for i in range(4)]
        if all(ids):
            refs.append([eng.kv.pool.blocks[b].ref_cnt for b in ids[0][:5]])
            assert all(x[:5] == ids[0][:5] for x in ids)  # one copy of the prompt's blocks
    assert refs and refs[0] == [4] * 5
    outs = llm.generate([prompt], params)[0].outputs
    assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) == 4
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert eng.kv.num_free_blocks == eng.num_blocks


def test_min_tokens_and_stop_token_ids(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32")
    prompt = random_prompts(1, 10, 10, 320, seed=14)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
    stop_tok = free[2]
    first = free.index(stop_tok)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0,
                                                    stop_token_ids=[stop_tok]))[0]
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_tok
    late = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=8,
                                                 stop_token_ids=[stop_tok]))[0]
    assert len(late.token_ids) >= 8 and stop_tok not in late.token_ids[:7]


@torch.inference_mode()
def test_engine_repetition_penalty_equals_hf_generate(tiny_models) -> None:
    """Greedy with repetition_penalty through the whole engine, token for token against
    HF generate: a batch where only some rows are penalized (the sampler's subset path)
    and one where all are (in place on the step's logits)."""
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32")
    prompts = random_prompts(4, 5, 40, 320, seed=21)
    model = hf_model(path)

    def hf(p: list[int], pen: float) -> list[int]:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=24, pad_token_id=0, eos_token_id=None,
                             repetition_penalty=pen)
        return out[0, len(p):].tolist()

    for pens in ([1.3, 1.0, 1.8, 1.0], [1.3, 1.1, 1.8, 2.5]):
        params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                 repetition_penalty=pen) for pen in pens]
        outs = llm.generate(prompts, params)
        for o, p, pen in zip(outs, prompts, pens):
            assert o.token_ids == hf(p, pen), pen


def test_argmax_rows_takes_the_first_of_equal_maxima() -> None:
    from engine.sampler import argmax_rows

    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    assert argmax_rows(x).tolist() == [1, 0, 2] == x.argmax(dim=-1).tolist()
    big = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_rows(big), big.argmax(dim=-1))


def test_non_finite_logits_and_top_k_past_the_vocabulary_still_sample() -> None:
    """Found by fuzzing the HTTP API, each once killed the engine thread: a
    repetition_penalty near 0 divides logits into +inf (softmax: NaN, and the draw fell
    past the vocabulary); a top_k larger than the vocabulary made an empty candidate
    set. Every drawn token is a real id, and an +inf logit wins."""
    vocab = 50
    s = Sampler(seed=0)
    logits = torch.randn(3, vocab)
    logits[0, 7] = float("inf")
    logits[1] = float("nan")
    logits[1, 4] = 1.0
    params = [SamplingParams(temperature=2e-5, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=1.0, top_k=MAX_TOP_K, seed=3)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    out = s(logits.clone(), _batch(params, gens))
    assert out.tokens[0] == 7 and out.tokens[1] == 4 and 0 <= out.tokens[2] < vocab
    probs = torch.zeros(2, vocab)  # no mass at all: still an id in range
    assert sampler_mod.sample_from(probs, torch.tensor([0.5, 0.99])).max() < vocab
