"""LoRA (rl/actor/lora.py, lora_io.py): the base frozen, the adapters alone trained, the engine given merged weights,
the reference the adapter-free base, checkpoints in PEFT's format, bad input named."""

import json
from pathlib import Path

import pytest
import torch

from tailrl.rl.actor.lora import adapters_off, add_adapters, base_state, lora_layers, merge_into
from tailrl.config.actor import LoraCfg
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


def test_the_fused_bf16_adapter_forward_equals_pefts_and_its_gradients_reach_the_fp32_masters(tiny_lm):
    """Over a bf16 base the adapters compute in bf16 with one fused addmm (lora.py `_lean_forward`); PEFT's own forward
    on the same layer rounds the adapter's product, its scaling and the sum separately. Bound: three bf16 roundings
    (unit roundoff 2^-8 each) of values of the output's size, so |diff| <= 3 * 2^-8 * max|out|; the gradients of
    the fp32 A and B likewise, relative to their size. Adapters off: the base's output, bit for bit."""
    import copy

    policy = add_adapters(copy.deepcopy(tiny_lm[0]).to(torch.bfloat16), LoraCfg(rank=4, alpha=8))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    layer = next(iter(lora_layers(policy).values()))
    assert layer.lora_A["default"].weight.dtype == torch.float32 and "_lean_forward" in str(layer.forward)
    x = torch.randn(2, 7, layer.in_features, dtype=torch.bfloat16)
    outs, grads = [], []
    for fwd in (layer.forward, lambda t: type(layer).forward(layer, t)):  # ours, PEFT's
        layer.zero_grad(set_to_none=True)
        y = fwd(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        outs.append(y.float())
        grads.append([layer.lora_A["default"].weight.grad.clone(), layer.lora_B["default"].weight.grad.clone()])
    assert all(g.dtype == torch.float32 for g in grads[0])
    bound = 3 * 2**-8
    torch.testing.assert_close(outs[0], outs[1], atol=bound * outs[1].abs().max().item(), rtol=0)
    for a, b in zip(*grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=bound * b.abs().max().item(), rtol=0)
    with torch.no_grad(), adapters_off(policy):
        assert torch.equal(layer(x), layer.get_base_layer()(x))


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
    from tailrl.model.tiny import make_tiny_checkpoint

    import copy

    model = add_adapters(copy.deepcopy(tiny_lm[0]), LoraCfg(rank=2, alpha=4))
    save_adapter(model, tmp_path / "adapter", LoraCfg(rank=2, alpha=4), str(tmp_path / "other"))
    make_tiny_checkpoint(tmp_path / "other", "llama")  # 96 words against the adapter's base's 24
    with pytest.raises(ValueError, match="trained on another base model .* vocab_size is 24 there and 96 here"):
        load_any(str(tmp_path / "adapter"))


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fp32_runs(tiny_chat, task_file, tmp_path_factory):
    """Two fp32 LoRA runs of 2 steps from the same seed, speculation off and always on (history drafts)."""
    from tailrl.rl.run import train

    out = {}
    for mode in ("off", "history"):
        cfg = tiny_cfg(tiny_chat, task_file, tmp_path_factory.mktemp(f"lora_{mode}"), "trainer.steps=2", *LORA,
                       "model.dtype=float32", f"rollout.spec.mode={mode}", "actor.lora.merged_export=true")
        out[mode] = train(cfg)
    return out


@pytest.mark.slow
def test_speculation_on_and_off_draw_the_same_tokens_with_lora(fp32_runs):
    from safetensors.torch import load_file

    off, on = (_rows(fp32_runs[m]) for m in ("off", "history"))
    assert on[-1]["spec/accept_length"] > 1  # speculation ran
    for a, b in zip(off, on):  # step 2 samples from the LoRA-updated (merged) weights
        for key in ("response_lengths", "reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[key] == b[key], (a["step"], key)
    wa, wb = (load_file(str(fp32_runs[m] / "checkpoints" / "step_000002" / "model" / "adapter_model.safetensors"))
              for m in ("off", "history"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(bool(wa[k].abs().sum() > 0) for k in wa if ".lora_B." in k)  # the adapter moved


@pytest.mark.slow
def test_peft_loads_the_saved_adapter_and_its_greedy_tokens_equal_ours(fp32_runs, tiny_chat):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tailrl.engine import Engine, EngineConfig, SamplingParams
    from tailrl.rl.evaluate import resolve_source

    src = resolve_source(str(fp32_runs["off"]))  # a run folder: its latest checkpoint's adapter
    adapter = src.model
    assert json.loads((Path(adapter) / "adapter_config.json").read_text())["r"] == 4
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32), adapter).eval()
    ours, tok = load_any(adapter, device="cpu", dtype=torch.float32)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in ("7 + 8 =", "9 + 4 =", "a b c")]  # held out: the training prompts are "i + j =" with j = 3i mod 10
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine = Engine(ours, tok, EngineConfig(kv_cache_gb=0.05))
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for ids, comp in zip(prompts, got):
        seq = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(8):  # transformers + peft, greedy
                seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            want_logits = hf(seq).logits
            ours_logits, _ = ours.forward_full(seq)
        assert comp.token_ids == seq[0, len(ids):].tolist()
        assert torch.allclose(ours_logits, want_logits, atol=1e-4, rtol=1e-4)  # fp32, ~1e-6 apart in practice
    # the merged HF export (actor.lora.merged_export) is that same model
    from tailrl.model import load_model

    merged = load_model(str(Path(adapter).parent / "merged"), device="cpu", dtype=torch.float32)[0]
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), ours.state_dict().values()))
    # `tailrl generate` on the adapter folder: greedy, the same tokens as above
    from tailrl.cli import main

    (Path(adapter).parent / "p.jsonl").write_text(json.dumps({"prompt": "7 + 8 ="}) + "\n")
    out = Path(adapter).parent / "gen.jsonl"
    assert main(["generate", "--model", adapter, "--prompts", str(Path(adapter).parent / "p.jsonl"), "--out", str(out),
                 "--max-tokens", "8", "--temperature", "0", "--dtype", "float32", "--spec", "off", "--kv-cache-gb",
                 "0.05", "--quiet"]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    assert row["token_ids"] == got[0].token_ids[:len(row["token_ids"])]  # generate stops at EOS; ours ignored it
    # and a merged adapter differs from the base: the comparison saw the adapter
    base = AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(base(seq).logits, want_logits, atol=1e-4)


@pytest.mark.slow
def test_a_lora_run_resumes_exactly(tiny_chat, task_file, tmp_path):
    from safetensors.torch import load_file

    from tailrl.rl.run import train

    extra = (*LORA, "model.dtype=float32", "algo.mini_batch_size=8")
    full = train(tiny_cfg(tiny_chat, task_file, tmp_path / "full", "trainer.steps=3", *extra))
    part = tmp_path / "part"
    train(tiny_cfg(tiny_chat, task_file, part, "trainer.steps=2", *extra))
    train(tiny_cfg(tiny_chat, task_file, part, "trainer.steps=3", "trainer.resume=true", *extra))
    a, b = _rows(full), _rows(part)
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_lengths"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-5, abs=1e-6), key
    wa, wb = (load_file(str(d / "checkpoints" / "step_000003" / "model" / "adapter_model.safetensors"))
              for d in (full, part))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa)
