"""Speculative decoding (engine/spec_decode.py, engine/spec_draft.py): greedy output equals
HF's token for token with n-gram and draft proposers, under every scheduling regime;
sampled output keeps its distribution (chi-square over 20,000 draws); stop strings,
max_tokens, EOS, logprobs, constraints and the off-switch; no block leaks."""

from __future__ import annotations

import math
import os
from array import array
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec_decode import NgramProposer
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

REGIMES = {
    "one-big-batch": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=64),
}


def _prompts(seed: int) -> list[list[int]]:
    """Random prompts, and prompts that repeat a phrase (prompt lookup finds those)."""
    g = torch.Generator().manual_seed(seed)
    loops = [torch.randint(3, 320, (int(n),), generator=g).tolist() * 4 for n in (3, 5, 7)]
    return random_prompts(5, 3, 50, 320, seed=seed) + loops


def _clean(llm: LLM) -> None:
    eng = llm.engine
    assert eng.kv.num_free_blocks == eng.num_blocks, "blocks leaked"
    eng.kv.check_integrity()
    assert not eng.scheduler.requests
    if eng.speculator is not None and hasattr(eng.speculator.proposer, "seqs"):
        assert not eng.speculator.proposer.seqs  # the draft's state went with its requests


def _spec_totals(outs) -> tuple[int, int, int]:
    t = [o.spec for o in outs if o.spec is not None]
    return tuple(sum(x[i] for x in t) for i in range(3)) if t else (0, 0, 0)  # type: ignore[return-value]


# -- n-gram lookup ----------------------------------------------------------------------


def _buf(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def test_ngram_lookup_takes_the_newest_longest_match() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    # "1 2 3" occurs twice before the end; the newest occurrence is followed by 9 9
    toks = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3]
    assert p.lookup(_buf(toks), 3) == [9, 9, 7]
    assert p.lookup(_buf(toks), 1) == [9]
    # no 3- or 2-gram match: falls back to n = 1 (token 8 seen once before)
    assert p.lookup(_buf([8, 6, 5, 4, 8]), 2) == [6, 5]
    assert p.lookup(_buf([1, 2, 3, 4]), 4) == []  # nothing repeats
    # a proposal stops at the end of the known tokens
    assert p.lookup(_buf([5, 6, 5]), 4) == [6, 5]
    assert NgramProposer(min_n=2, max_n=3).lookup(_buf([8, 6, 5, 4, 8]), 2) == []


def test_ngram_lookup_skips_matches_that_straddle_two_ids() -> None:
    # as bytes, 0x00000100 0x00000002 contains 01 00 00 00 02 00 00 00 at offset 1:
    # the pattern [1, 2] must not match there
    p = NgramProposer(min_n=2, max_n=2)
    toks = [256, 2 << 24, 7, 1, 2]
    assert p.lookup(_buf(toks), 2) == []
    assert p.lookup(_buf([1, 2, 5, 256, 2 << 24, 1, 2]), 2) == [5, 256]


# -- greedy parity ------------------------------------------------------------------------


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias"])
def test_ngram_greedy_equals_hf(tiny_models, model: str, regime: str) -> None:
    arch, cfg = (("llama", dict(num_attention_heads=4, num_key_value_heads=2))
                 if model == "llama-gqa" else
                 ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1)))
    path = tiny_models(arch, 0, **cfg)
    prompts = _prompts(11)
    llm = LLM(model=str(path), dtype="float32", debug=True, speculative="ngram",
              num_speculative_tokens=4, speculative_min_acceptance=0.0, **REGIMES[regime])
    got = llm.generate(prompts, GREEDY)
    want = hf_greedy(path, prompts, GREEDY.max_tokens)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w, f"prompt {i} diverged"
    steps, proposed, accepted = _spec_totals(got)
    assert steps > 0 and accepted > 0, "nothing was speculated"
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    _clean(llm)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_draft_greedy_equals_hf(tiny_models, regime: str) -> None:
    """A tiny random draft (another seed: it disagrees often) for a tiny random target,
    and the target as its own draft (it agrees always)."""
    path = tiny_models("llama", 0)
    prompts = _prompts(12)
    want = hf_greedy(path, prompts, GREEDY.max_tokens)
    for draft, full in ((tiny_models("llama", 3), False), (path, True)):
        llm = LLM(model=str(path), dtype="float32", debug=True, speculative="draft",
                  draft_model=str(draft), num_speculative_tokens=3,
                  speculative_min_acceptance=0.0, **REGIMES[regime])
        got = llm.generate(prompts, GREEDY)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.token_ids == w, f"prompt {i} diverged (draft {draft.name})"
        steps, proposed, accepted = _spec_totals(got)
        assert steps > 0 and accepted > 0
        if full and regime == "one-big-batch":
            assert accepted == proposed  # its own draft: every proposal is right
        _clean(llm)


def test_draft_must_share_the_vocabulary(tiny_models) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=str(tiny_models("llama", 0)), dtype="float32", speculative="draft",
            draft_model=str(tiny_models("llama", 0, vocab_size=64)))


def test_aborts_and_park_leave_no_blocks(tiny_models) -> None:
    """Abort requests mid-speculation and park/unpark others: every block comes back,
    the parked ones end exactly as without."""
    path = tiny_models("llama", 0)
    prompts = _prompts(13)
    for method, extra in (("ngram", {}), ("draft", {"draft_model": str(tiny_models("llama", 3))})):
        llm = LLM(model=str(path), dtype="float32", debug=True, speculative=method,
                  speculative_min_acceptance=0.0, block_size=4, num_kv_blocks=64, **extra)
        eng = llm.engine
        reqs = [eng.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
        for r in reqs:
            eng.add(r)
        toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        steps = 0
        while eng.has_unfinished() or eng.scheduler.parked:
            steps += 1
            if steps == 6:
                eng.abort(["r0", "r5"])
                assert eng.park(["r6", "r7"]) == 2
            if steps == 9:
                assert eng.unpark(["r6", "r7"]) == 2
            for out in eng.step():
                toks[out.request_id] += out.new_token_ids
        want = hf_greedy(path, prompts, GREEDY.max_tokens)
        for i in (1, 2, 3, 4, 6, 7):
            assert toks[f"r{i}"] == want[i], f"{method}: r{i} diverged"
        assert sum(r.spec_accepted for r in reqs) > 0
        _clean(llm)


# -- several tokens a step: stops, lengths, logprobs ------------------------------------------


def test_stop_strings_eos_and_max_tokens_match_without(tiny_chat_model) -> None:
    """A delta may carry several tokens: a stop string still ends the output at the token
    that completed it, EOS and stop tokens too, max_tokens is never passed; text, token
    ids, finish and stop reasons match a run without speculation."""
    base = LLM(model=str(tiny_chat_model), dtype="float32")
    spec = LLM(model=str(tiny_chat_model), dtype="float32", speculative="ngram",
               speculative_min_acceptance=0.0, debug=True)
    text = "the cat sat on the mat. " * 6
    free = base.generate([text], SamplingParams(max_tokens=48, temperature=0.0,
                                                ignore_eos=True))[0]
    assert len(free.token_ids) == 48
    words = free.text.split()
    stop_word = words[len(words) // 2] if words else "the"
    cases = [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop_word]),
        SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[free.token_ids[9]]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=3),
    ]
    for params in cases:
        want = base.generate([text], params)[0]
        got = spec.generate([text], params)[0]
        assert got.token_ids == want.token_ids, params
        assert got.text == want.text
        assert (got.finish_reason, got.outputs[0].stop_reason) == (
            want.finish_reason, want.outputs[0].stop_reason)
        if params.logprobs:
            assert [lp.token_id for lp in got.outputs[0].logprobs] == want.token_ids
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
                assert math.isclose(a.logprob, b.logprob, abs_tol=1e-3)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.generate([text], cases[-1])[0].spec[2] > 0  # it did accept proposals
    _clean(spec)


def test_a_stop_string_before_max_tokens_in_one_step_reports_stop(tiny_chat_model) -> None:
    """A step whose accepted run both completes a stop string and reaches max_tokens
    ends on the stop string with finish_reason "stop", as one token a step would. (The
    target as its own draft: every proposal is accepted, steps of 5 tokens.)"""
    base = LLM(model=str(tiny_chat_model), dtype="float32")
    spec = LLM(model=str(tiny_chat_model), dtype="float32", speculative="draft",
               draft_model=str(tiny_chat_model), speculative_min_acceptance=0.0)
    text = "the cat sat on the mat. " * 4
    free = base.generate([text], SamplingParams(max_tokens=24, temperature=0.0,
                                                ignore_eos=True))[0]
    tok = base.engine.tokenizer
    seen = 0
    for j in range(2, 20):
        piece = tok.decode(free.token_ids[j: j + 1]).strip()
        before = tok.decode(free.token_ids[:j])
        if len(piece) < 2 or piece in before:
            continue
        params = SamplingParams(max_tokens=j + 2, temperature=0.0, ignore_eos=True,
                                stop=[piece])
        want, got = base.generate([text], params)[0], spec.generate([text], params)[0]
        assert got.token_ids == want.token_ids and got.text == want.text, j
        assert (got.finish_reason, got.outputs[0].stop_reason) == ("stop", piece), j
        seen += 1
    assert seen >= 3
    _clean(spec)


def test_constrained_output_with_proposals(tiny_chat_model) -> None:
    """A response_format's mask applies to every verified row (its automaton walked
    along the proposals): the output matches the run without speculation and parses."""
    import json

    base = LLM(model=str(tiny_chat_model), dtype="float32")
    spec = LLM(model=str(tiny_chat_model), dtype="float32", speculative="ngram",
               speculative_min_acceptance=0.0, debug=True)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20},
                                               "b": {"type": "string", "maxLength": 20}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            response_format={"type": "json_schema",
                                             "json_schema": {"schema": schema}})
    prompt = 'Answer {"a": "x", "b": "y"} {"a": "x", "b": "y"}'
    want = base.generate([prompt], params)[0]
    got = spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    json.loads(got.text)
    assert got.spec is not None and got.spec[0] > 0
    _clean(spec)


def test_off_switch_pauses_a_request_that_keeps_missing(tiny_models) -> None:
    path = tiny_models("llama", 0)
    prompt = _prompts(14)[-1]
    on = LLM(model=str(path), dtype="float32", speculative="ngram", seed=3,
             speculative_ngram_min=1, speculative_min_acceptance=1.0)  # any rejection trips it
    out = on.generate([prompt], SamplingParams(max_tokens=200, temperature=1.0,
                                               ignore_eos=True))[0]
    steps, proposed, accepted = out.spec
    assert accepted < proposed
    # 4 probing steps, then 8, 16, 32, ... steps off: far fewer verifying steps than tokens
    assert steps < 60
    opt_out = on.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                   ignore_eos=True, speculative=False))[0]
    assert opt_out.spec is None


# -- sampled output keeps its distribution -------------------------------------------------


def _chi2_two_sample(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples of token ids share a distribution
    (cells with fewer than 10 expected draws pooled)."""
    ca, cb = torch.bincount(torch.tensor(a)), torch.bincount(torch.tensor(b))
    n = max(len(ca), len(cb))
    ca = torch.nn.functional.pad(ca, (0, n - len(ca))).double()
    cb = torch.nn.functional.pad(cb, (0, n - len(cb))).double()
    tot = ca + cb
    big = tot >= 20
    ca = torch.cat([ca[big], ca[~big].sum()[None]])
    cb = torch.cat([cb[big], cb[~big].sum()[None]])
    tot = ca + cb
    keep = tot > 0
    ca, cb, tot = ca[keep], cb[keep], tot[keep]
    na, nb = ca.sum(), cb.sum()
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    df = len(tot) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


# make test: 4,000 draws per run; make spec: the full 20,000
DRAWS = int(os.environ.get("TIDEWIRE_SPEC_DRAWS", "2000"))


def _near_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """A draft model: `src`'s weights plus Gaussian noise (`noise` x each tensor's std),
    so it agrees with its target often but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        w = load_file(f)
        save_file({k: v + noise * v.float().std() * torch.randn(v.shape, generator=g)
                   if v.numel() > 1 else v for k, v in w.items()}, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_distribution_is_kept(tiny_models, tmp_path, top_p: float) -> None:
    """20,000 samples (make spec; 2,000 in make test) of a peaked tiny model's 2nd to
    4th tokens (the positions verified with proposals), with and without speculation,
    n-gram and draft: chi-square p > 0.001 for each position and proposer (12
    comparisons in all: a sound sampler then fails ~1% of machines' random streams; it
    failed at 0.0086 once at 4,000 draws and passed at 20,000). The prompt is
    the model's own greedy text, so that prompt lookup proposes what the model often
    samples (both the accepting and the rejecting paths run thousands of times)."""
    target = tiny_models("llama", 0, vocab_size=24, initializer_range=0.6)
    draft = _near_copy(target, tmp_path / "draft", noise=0.05)
    common = dict(dtype="float32", max_num_seqs=512, max_num_batched_tokens=4096,
                  speculative_min_acceptance=0.0, speculative_max_batch=0)
    plain = LLM(model=str(target), seed=7, **common)
    habit = plain.generate([[3, 4, 5]], SamplingParams(max_tokens=40, temperature=0.0,
                                                       ignore_eos=True))[0].token_ids
    prompt = [3, 4, 5] + habit
    params = SamplingParams(max_tokens=4, temperature=1.0, top_p=top_p, ignore_eos=True)
    runs = {"plain": [o.token_ids for o in plain.generate([prompt] * DRAWS, params)]}
    for name, kw in (("ngram", dict(speculative="ngram", speculative_ngram_min=1)),
                     ("draft", dict(speculative="draft", draft_model=str(draft)))):
        llm = LLM(model=str(target), seed=7, **common, **kw)
        outs = llm.generate([prompt] * DRAWS, params)
        runs[name] = [o.token_ids for o in outs]
        steps, proposed, accepted = _spec_totals(outs)
        # many proposals both kept and rejected
        assert steps >= DRAWS // 2 and DRAWS // 10 < accepted < proposed - DRAWS // 10, \
            (name, steps, proposed, accepted)
    for pos in (1, 2, 3):
        base = [t[pos] for t in runs["plain"]]
        for name in ("ngram", "draft"):
            p = _chi2_two_sample(base, [t[pos] for t in runs[name]])
            assert p > 0.001, f"{name}, token {pos}: p = {p:.2g}"


def test_seeded_sampling_does_not_speculate(tiny_models) -> None:
    """One draw per token keeps a seeded request exact when a replica continues it from
    its tokens: it runs as it would without speculation."""
    path = tiny_models("llama", 0)
    prompt = _prompts(15)[-1]
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    base = LLM(model=str(path), dtype="float32").generate([prompt], params)[0]
    out = LLM(model=str(path), dtype="float32", speculative="ngram").generate([prompt], params)[0]
    assert out.token_ids == base.token_ids and out.spec is None


async def test_server_reports_acceptance_in_done_and_metrics(tiny_chat_model) -> None:
    """`tidewire serve --speculative ngram`: a socket's done.timings carry the request's
    acceptance, /metrics its histograms; `speculative: false` opts a request out; several
    tokens may come in one delta, and the text is the offline run's."""
    import json as _json

    from websockets.asyncio.client import connect

    from engine import EngineConfig
    from engine.config import SpeculativeConfig
    from service.config import ServiceConfig
    from tests.servers import run_server, scrape_metrics

    cfg = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32",
                                            speculative=SpeculativeConfig("ngram",
                                                                          min_acceptance=0.0)))
    text = "the cat sat on the mat. " * 6
    with run_server(cfg) as s:
        async with connect(s.ws_url, subprotocols=["tidewire.v1.json"]) as ws:
            assert _json.loads(await ws.recv())["type"] == "ready"
            for rid, spec in (("on", True), ("off", False)):
                await ws.send(_json.dumps({"type": "generate", "id": rid, "prompt": text,
                                           "params": {"max_tokens": 40, "temperature": 0,
                                                      "ignore_eos": True,
                                                      "speculative": spec}}))
            frames: dict[str, list[dict]] = {"on": [], "off": []}
            while not all(f and f[-1]["type"] == "done" for f in frames.values()):
                m = _json.loads(await ws.recv())
                if "id" in m:
                    frames[m["id"]].append(m)
        want = LLM(model=str(tiny_chat_model), dtype="float32").generate(
            [text], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
        for rid in ("on", "off"):
            deltas = [m for m in frames[rid] if m["type"] == "delta"]
            assert [t for d in deltas for t in d["token_ids"]] == want.token_ids
            assert "".join(d["text"] for d in deltas) == want.text
        on, off = frames["on"][-1]["timings"], frames["off"][-1]["timings"]
        assert on["spec_steps"] > 0 and 0 < on["spec_accepted"] <= on["spec_proposed"]
        assert on["spec_acceptance"] == round(on["spec_accepted"] / on["spec_proposed"], 4)
        assert max(len(m["token_ids"]) for m in frames["on"] if m["type"] == "delta") > 1
        assert not any(k.startswith("spec_") for k in off)
        metrics = scrape_metrics(s.url)
        assert metrics["tidewire_spec_acceptance_ratio_count"] == 1
        assert metrics["tidewire_spec_accepted_tokens_per_step_sum"] == pytest.approx(
            on["spec_accepted_per_step"], abs=1e-3)
