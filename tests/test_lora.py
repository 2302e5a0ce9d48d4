"""LoRA (rl/actor/lora.py, lora_io.py): the base frozen, the adapters alone trained, the engine given merged weights,
the reference the adapter-free base, checkpoints in PEFT's format, bad input named."""

import json

import pytest
import torch

from tailrl.rl.actor.lora import adapters_off, add_adapters, base_state, lora_layers, merge_into
from tailrl.rl.actor.lora_config import LoraCfg
from tailrl.rl.actor.lora_io import load_any, save_adapter
from tests.rl_helpers import tiny_cfg

LORA = ("actor.lora.rank=4", "actor.lora.alpha=8")


def _trainer(tiny_chat, task_file, out, *extra):
    from tailrl.rl.trainer import Trainer

    return Trainer(tiny_cfg(tiny_chat, task_file, out, "trainer.steps=2", *LORA, *extra))


@pytest.fixture(scope="module")
def trained(tiny_chat, task_file, tmp_path_factory):
    """A bf16 LoRA trainer before and after one step (KL on, so the reference is computed too)."""
    tr = _trainer(tiny_chat, task_file, tmp_path_factory.mktemp("lora"), "model.dtype=bfloat16",
                  "model.train_compute=bfloat16", "algo.kl_coef=0.1")
    before = {n: p.detach().clone() for n, p in tr.actor.policy.named_parameters()}
    tr.train_step()
    return tr, before


@pytest.mark.slow  # a train step (the `trained` fixture)
def test_gradients_reach_only_the_adapters(trained):
    tr, before = trained
    policy, opt = tr.actor.policy, tr.actor.optimizer
    lora = {n for n in before if ".lora_" in n}
    assert lora and all(".lora_A." in n or ".lora_B." in n for n in lora)
    for n, p in policy.named_parameters():
        if n in lora:
            assert p.requires_grad and p.dtype == torch.float32, n
        else:  # frozen, in the compute dtype (no fp32 master of the base), untouched bit for bit
            assert not p.requires_grad and p.dtype == torch.bfloat16, n
            assert torch.equal(p, before[n]), n
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters() if ".lora_B." in n)
    trained_ids = {id(p) for p in policy.parameters() if p.requires_grad}
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in opt_params} == trained_ids and len(opt_params) == len(lora)
    assert all(id(p) in trained_ids for p in opt.state)  # moments for the adapters alone


@pytest.mark.slow  # a train step (the `trained` fixture)
def test_the_engine_runs_the_merged_weights_and_the_base_stays(trained):
    tr, before = trained
    policy, engine = tr.actor.policy, tr.actor.engine_model
    assert engine is tr.engine.model and not lora_layers(engine)  # an ordinary model
    layers = lora_layers(policy)
    esd = engine.state_dict()
    for name, layer in layers.items():
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        want = (layer.get_base_layer().weight.float() + (b @ a) * layer.scaling["default"]).to(engine.dtype)
        assert layer.scaling["default"] == 2.0  # alpha 8 / rank 4
        assert torch.equal(esd[name + ".weight"], want), name
    base = base_state(policy)
    assert base.keys() == esd.keys()
    for n, t in esd.items():  # the tensors without an adapter: the base's own
        if n.removesuffix(".weight") not in layers:
            assert torch.equal(t, base[n]), n


def test_merge_then_unmerge_restores_the_base_bit_for_bit(tiny_lm):
    import copy

    base = copy.deepcopy(tiny_lm[0]).to(torch.bfloat16)
    engine = copy.deepcopy(base)
    policy = add_adapters(copy.deepcopy(base), LoraCfg(rank=4, alpha=8))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.normal_()
    merge_into(policy, engine)
    assert any(not torch.equal(a, b) for a, b in zip(engine.parameters(), base.parameters()))
    with torch.no_grad():  # the adapter set back to zero: the next merge writes the base again, bit for bit
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.zero_()
    merge_into(policy, engine)
    assert all(torch.equal(a, b) for a, b in zip(engine.state_dict().values(), base.state_dict().values()))


@pytest.mark.slow  # a train step (the `trained` fixture)
def test_the_kl_reference_is_the_adapter_free_base(trained, tiny_chat):
    from tailrl.engine import SamplingParams
    from tailrl.model import load_model
    from tailrl.rl.actor.forward import make_batch, no_grad_logprobs

    tr, _ = trained
    ref, policy = tr.actor.ref, tr.actor.policy
    assert ref.policy is policy  # no second copy of the weights
    base = load_model(tiny_chat, device="cpu", dtype=torch.bfloat16)[0]
    comps = tr.rollout.engine.generate([tr.train_set[0].ids, tr.train_set[1].ids],
                                       SamplingParams(max_tokens=6, seed=1, ignore_eos=True))
    batch = make_batch(comps, 0)
    want = no_grad_logprobs(base, batch, 8, 0.7)
    got = no_grad_logprobs(ref, batch, 8, 0.7)
    assert torch.equal(got, want)  # the same bf16 weights and the same passes: the same numbers
    adapted = no_grad_logprobs(policy, batch, 8, 0.7)
    assert not torch.equal(adapted, want)  # and the policy itself is not the base any more
    with adapters_off(policy):
        assert torch.equal(no_grad_logprobs(policy, batch, 8, 0.7), want)
    assert all(p.requires_grad for n, p in policy.named_parameters() if ".lora_" in n)  # switched back on


@pytest.mark.parametrize("bad, why", [
    (("actor.lora.target_modules=[q_proj,qkv_proj]",), "no layer named 'qkv_proj'"),
    (("actor.lora.rank=65",), "above the width of model.layers.0.self_attn.q_proj"),
])
def test_bad_lora_settings_name_the_problem(tiny_chat, task_file, tmp_path, bad, why):
    with pytest.raises(ValueError, match=why):
        _trainer(tiny_chat, task_file, tmp_path, *bad)


def test_an_adapter_for_another_base_is_refused(tiny_lm, tmp_path):
    from tests.conftest import make_tiny_checkpoint

    import copy

    model = add_adapters(copy.deepcopy(tiny_lm[0]), LoraCfg(rank=2, alpha=4))
    save_adapter(model, tmp_path / "adapter", LoraCfg(rank=2, alpha=4), str(tmp_path / "other"))
    make_tiny_checkpoint(tmp_path / "other", "llama")  # 96 words against the adapter's base's 24
    with pytest.raises(ValueError, match="trained on another base model .* vocab_size is 24 there and 96 here"):
        load_any(str(tmp_path / "adapter"))
