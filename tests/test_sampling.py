"""SamplingParams validation and the sampler's greedy / top-k / top-p / seed behaviour."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplingBatch
from tests.conftest import random_prompts


@pytest.mark.parametrize("kw,name", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed="x"), "seed"),
])
def test_invalid_params_name_the_parameter(kw: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_unknown_keys_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})
    assert SamplingParams.from_dict({"max_tokens": 3}).max_tokens == 3


def _batch(params: list[SamplingParams], gens=None) -> SamplingBatch:
    return SamplingBatch(params, gens or [None] * len(params))


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    out = Sampler()(logits, _batch([SamplingParams(temperature=0.0)] * 5))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_and_top_p_restrict_the_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    top5 = set(logits[0].topk(5).indices.tolist())
    s = Sampler(seed=1)
    draws = {s(logits, _batch([SamplingParams(temperature=1.0, top_k=5)])).item()
             for _ in range(300)}
    assert draws <= top5 and len(draws) > 1
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    draws = {s(logits, _batch([SamplingParams(temperature=1.0, top_p=0.5)])).item()
             for _ in range(300)}
    assert draws <= nucleus and len(draws) >= 1


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(seed=0)
    counts = torch.bincount(torch.stack([s(logits, _batch([SamplingParams(temperature=1.0)]))
                                         for _ in range(2000)]).view(-1), minlength=3)
    freq = counts.float() / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]
    out = Sampler()(logits, _batch(params, [None, torch.Generator().manual_seed(1), None, None]))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_request_same_alone_or_in_any_batch(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=32)
    prompts = random_prompts(5, 5, 40, 320, seed=11)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.3, top_k=7, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.5, ignore_eos=True)]
    mixed = llm.generate([prompts[1], prompts[2], prompts[0], prompts[3], prompts[4]],
                         [others[0], others[1], seeded, others[2], others[3]])
    assert mixed[2].token_ids == alone
    again = llm.generate([prompts[4], prompts[0]], [others[3], seeded])[1].token_ids
    assert again == alone
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=4321,
                                ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed)[0].token_ids != alone
