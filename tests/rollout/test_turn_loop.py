"""The one turn loop (rollout/turns.py) over the StepEngine protocol (rollout/base.py): with no tools a request is one
turn, and the loop draws exactly what Engine.generate draws; its partial hooks stop early and export the rest,
which continue to the very tokens of a straight run (with tools: tests/agent/test_partial_tools.py); what it refuses, it
refuses by name."""

import typing

import pytest

from tailrl.config import RolloutCfg
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.rollout.base import StepEngine, make_requests, requests_of, step_params, step_seed
from tailrl.rollout.turns import TurnLoop
from tailrl.rollout.vllm.turns import VllmTurns
from tailrl.speculative.config import SpecConfig
from tests.helpers import tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (9, 17, 5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=11)


def _engine(model, mode="off") -> Engine:
    return Engine(model, None, EngineConfig(kv_cache_gb=0.05, seed=0, spec=SpecConfig(mode=mode, min_match=1),
                                            batch_invariant=True))


def _params():
    return [SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=5 + i) for i in range(len(PROMPTS))]


def test_both_engines_have_every_call_of_the_protocol():
    calls = [n for n in vars(StepEngine) if not n.startswith("_")] + list(typing.get_type_hints(StepEngine))
    for cls in (Engine, VllmTurns):
        assert [n for n in calls if not hasattr(cls, n) and n != "tokenizer"] == [], cls


def test_requests_carry_the_step_seed():
    r = RolloutCfg(n=3, temperature=0.7, top_k=5, top_p=0.9, max_tokens=17)
    p = step_params(r, 7, 4, 2, 1)
    assert (p.n, p.temperature, p.top_k, p.top_p, p.max_tokens, p.seed) == (3, 0.7, 5, 0.9, 17, step_seed(7, 4, 2, 1))
    g = step_params(r, 7, 0, 2, greedy=True)
    assert (g.n, g.temperature, g.top_k, g.top_p) == (1, 0.0, 0, 1.0)

    class Ex:
        def __init__(self, ids, prompt):
            self.ids, self.prompt = ids, prompt

    reqs = make_requests([Ex([1, 2], "a"), Ex([3], "b")], r, 7, 4, system_prompt="sys")
    assert [q.params.seed for q in reqs] == [step_seed(7, 4, i) for i in range(2)]
    assert reqs[1].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "b"}]


@pytest.mark.parametrize("mode", ["off", "ngram"])
def test_single_turn_draws_what_generate_draws(tiny, mode):
    model = tiny
    ref = _engine(model, mode).generate(PROMPTS, _params())
    eng = _engine(model, mode)
    out = TurnLoop().run(eng, requests_of(PROMPTS, _params()))
    assert out.metrics == {} and out.left == [] and len(out.records) > 0
    assert [(c.prompt_index, c.sample_index) for c in out.completions] == [(c.prompt_index, c.sample_index) for c in ref]
    assert [c.token_ids for c in out.completions] == [c.token_ids for c in ref]
    assert [c.logprobs for c in out.completions] == [c.logprobs for c in ref]
    assert out.completions.stats.generated_tokens == ref.stats.generated_tokens


def test_stopped_early_and_continued_equals_the_straight_run(tiny):
    model = tiny
    straight = _engine(model).generate(PROMPTS, _params())
    eng = _engine(model)
    seen = []
    first = TurnLoop().run(eng, requests_of(PROMPTS, _params()), on_step=seen.append,
                           done=lambda fin: len(fin) > 0)
    assert first.left and len(seen) == len(first.records)
    rest = TurnLoop().run(eng, [], states=first.left)
    got = {(c.prompt_index, c.sample_index): c.token_ids for c in [*first.completions, *rest.completions]}
    assert got == {(c.prompt_index, c.sample_index): c.token_ids for c in straight}


def test_vllms_turns_refuse_export_and_import_by_name():
    """Partial rollouts (with tools or not) carry sequences through export / import_, which vLLM's turns adapter does
    not have: it says so rather than lose them (the config refuses rollout.partial with rollout.backend=vllm)."""
    turns = VllmTurns.__new__(VllmTurns)  # no LLM is needed to refuse
    with pytest.raises(NotImplementedError, match="not built yet"):
        turns.export([1])
    with pytest.raises(NotImplementedError, match="not built yet"):
        turns.import_([object()])
    assert turns.import_([]) == []
