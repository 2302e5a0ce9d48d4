import itertools
import json
import random

import pytest
import torch

from tailrl.drafter import DrafterConfig, EagleDrafter, load_drafter, make_speculator, save_drafter
from tailrl.drafter.buffer import DraftBuffer
from tailrl.drafter.offline import collect, split, train_epochs
from tailrl.drafter.propose import LearnedDrafter
from tailrl.drafter.train import DrafterTrainer
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.speculative.config import SpecConfig
from tests.stats import chisquare_pvalue
from tests.helpers import CHATS, assert_same_or_tie, exact_joint, tiny_draft_buffer

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


def trained_head(model, tok, prompts, cfg, n=4, max_tokens=16, steps=3, seed=0):
    buffer = collect(model, tok, prompts, n, max_tokens, 1.0, seed)
    head = EagleDrafter(model.config).to(dtype=model.dtype).bind(model)
    trainer = DrafterTrainer(head, cfg, seed=seed)
    train_epochs(trainer, list(buffer.items), steps, seed)
    trainer.publish(head)
    return head


def test_sampling_with_learned_drafts_follows_the_policy(tiny_peaked):
    """Rollouts drafted by a (briefly trained) EAGLE head with draft probabilities q, verified by rejection
    sampling, against the exact distribution of 4-token continuations; chi-square at significance 0.001."""
    D, N = 4, 3000
    prompt = [1, 2, 3, 1]
    cfg = DrafterConfig(draft_vocab=0, topk=2, min_prob=0.0, batch_tokens=64)
    head = trained_head(tiny_peaked, None, [[1, 2, 3, 1], [3, 2, 1, 0], [0, 1, 1, 2]], cfg, n=16, max_tokens=8)
    params = SamplingParams(temperature=0.9, max_tokens=D, n=N, seed=5, ignore_eos=True)
    joint = exact_joint(tiny_peaked, prompt, params, D)
    spec = SpecConfig(mode="learned", budgets=(3,))
    eng = Engine(tiny_peaked, None, EngineConfig(kv_cache_gb=0.5, spec=spec),
                 make_speculator(spec, LearnedDrafter(head, cfg)))
    outs = eng.generate([prompt], params)
    drafted = sum(o.stats["drafted"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    assert accepted > N // 4 and accepted < drafted, "the test needs both accepted and rejected drafts"
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert chisquare_pvalue(counts, joint) > 1e-3, "rollouts with learned drafts do not follow the policy"


@pytest.mark.parametrize("mode", ["learned", "auto"])
def test_greedy_with_learned_drafts_equals_plain_decoding(smollm, mode):
    """Greedy decoding with learned drafts verified equals plain decoding, two epochs. auto: what the selector
    would choose depends on measured step times (it once decoded plainly throughout), so its choice is forced in
    turn, from each epoch's first step, through every arm of the learned and merged drafters and plain decoding;
    then each epoch verifies learned drafts, and the second epoch's merged drafts carry the history's matches,
    which are accepted."""
    model, tok = smollm
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(CHATS, params)
    head = EagleDrafter(model.config, torch.arange(2000)).bind(model)
    spec = SpecConfig(mode=mode, epsilon=0.3)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=spec),
                 make_speculator(spec, LearnedDrafter(head, DrafterConfig(topk=3))))
    names, selector = ["learned"], eng.speculator.selector
    if mode == "auto":  # auto offers the learned and merged drafters to the selector next to the model-free ones
        assert {"learned", "history+learned"} <= {a.drafter for a in selector.arms}
        names.append("history+learned")
        arms = [[a for a in selector.arms if a.drafter == name] for name in ("learned", "history+learned", "")]
        turns = [a for step in itertools.zip_longest(*arms) for a in step if a is not None]
    for _ in range(2):
        if mode == "auto":  # each epoch: learned:1, history+learned:1, off, learned:2, ... (an epoch takes 2+ steps)
            turn = itertools.cycle(turns)
            selector.choose = lambda batch, contexts=None, *_, **__: next(turn)
        outs = eng.generate(CHATS, params)
        for ref, out in zip(plain, outs):
            assert_same_or_tie(model, ref, out, params, 1e-5)
        for name in names:
            assert outs.stats.drafters.get(name, {}).get("drafted", 0) > 0, f"no {name} drafts verified"
    if mode == "auto":
        assert outs.stats.drafters["history+learned"]["accepted"] > 0


def test_engine_captures_the_target_hidden_states(smollm):
    model, tok = smollm
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, capture_hidden=True, spec=SpecConfig(mode="history", min_match=1)))
    params = SamplingParams(temperature=0, max_tokens=12)
    eng.generate(CHATS[:2], params)
    out = eng.generate(CHATS[:2], params)[0]  # second epoch: verification passes with accepted drafts
    ids = torch.tensor(out.prompt_token_ids + out.token_ids)
    with torch.no_grad():
        _, hidden = model.forward_full(ids[None], hidden_layers=(model.config.num_hidden_layers,))
    ref = hidden[model.config.num_hidden_layers][0, :-1]
    assert out.hidden_states.shape == ref.shape
    assert torch.allclose(out.hidden_states, ref, atol=1e-3, rtol=1e-3)


def test_training_raises_top1_accuracy_on_held_out_prompts(smollm):
    """Fixed target and seed: the head trained on 24 prompts predicts the target's next token better on 6
    prompts it never saw (accuracy is top-1 agreement with the target over the draft vocabulary)."""
    from tailrl.tasks import chat_prompt
    from tailrl.tasks import make_rows

    model, tok = smollm
    torch.manual_seed(0)
    prompts = [chat_prompt(r["prompt"]) for r in make_rows("arithmetic", 30, 3)]
    buffer = collect(model, tok, prompts, 2, 40, 0.7, seed=0)
    train, held = split(list(buffer.items), 0.2, seed=0)
    assert len(held) >= 8 and not {tuple(s.tokens[: s.prompt_len]) for s in held} & {tuple(s.tokens[: s.prompt_len]) for s in train}
    from tailrl.drafter.eagle import choose_vocab

    vocab = choose_vocab(buffer.token_counts(model.config.vocab_size), 1024, model.config.eos_token_id)
    head = EagleDrafter(model.config, vocab).bind(model)
    trainer = DrafterTrainer(head, DrafterConfig(batch_tokens=512, lr=5e-4, warmup_steps=5), seed=0)
    before = trainer.evaluate(held)
    train_epochs(trainer, train, 4, seed=0)
    after = trainer.evaluate(held)
    assert after["drafter/top1_acc"] > before["drafter/top1_acc"] + 0.15, (before, after)
    assert after["drafter/loss"] < before["drafter/loss"]


def test_buffer_one_step_offset_sampling_and_bound(tiny_lm):
    model, _ = tiny_lm
    buffer = tiny_draft_buffer(model, steps=(0, 1, 2))
    rng = random.Random(0)
    picked = buffer.sample(400, rng, step=2)
    steps = {s.step for s in picked}
    assert steps == {1, 2}, "half from the current step, half from the previous one; step 0 is too old"
    small = DraftBuffer(max_tokens=100, steps=2)
    for s in list(buffer.items):
        small.add(s.tokens[: s.prompt_len], s.tokens[s.prompt_len :], s.hidden, s.step)
    assert small.tokens <= 100 and small.items[-1].step == 2


def test_export_then_reload_gives_identical_drafts(smollm, tmp_path):
    from tailrl.cli import main

    model, tok = smollm
    torch.manual_seed(1)
    head = EagleDrafter(model.config, torch.arange(0, 3000, 2)).bind(model)
    with torch.no_grad():
        for p in head.trainable():
            p.add_(0.02 * torch.randn_like(p))
    save_drafter(head, tmp_path / "native")
    assert main(["drafter", "export", str(tmp_path / "native"), "--out", str(tmp_path / "eagle")]) == 0
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= keys
    assert not any("input_layernorm" in k or "lm_head" in k or "embed" in k for k in keys)
    assert torch.equal(torch.load(tmp_path / "eagle" / "hot_token_ids.pt"), head.vocab)
    again = load_drafter(tmp_path / "eagle", model)
    params = SamplingParams(temperature=0.8, max_tokens=20, n=2, seed=3)
    trees = []
    for h in (head, again):
        drafter = LearnedDrafter(h, DrafterConfig(topk=3))
        spec = SpecConfig(mode="learned", budgets=(6,))
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=spec), make_speculator(spec, drafter))
        got = []
        orig = drafter.propose

        def spy(seqs, budgets, depths, orig=orig, got=got):
            out = orig(seqs, budgets, depths)
            got.extend((t.tokens, t.parents, {k: v.clone() for k, v in t.q.items()}) if t else None for t in out)
            return out

        drafter.propose = spy
        eng.generate(CHATS[:2], params)
        trees.append(got)
    assert len(trees[0]) == len(trees[1]) > 0
    for a, b in zip(*trees):
        assert (a is None) == (b is None)
        if a:
            assert a[0] == b[0] and a[1] == b[1]
            assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_drafter_config_errors_name_the_problem():
    from tailrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="drafter.topk"):
        load_config(None, ["drafter.topk=0"])
    with pytest.raises(ConfigError, match="spec.mode=learned"):
        load_config(None, ["rollout.spec.mode=learned"])
    with pytest.raises(ConfigError, match="unknown key 'drafter.nope'"):
        load_config(None, ["drafter.nope=1"])
    with pytest.raises(FileNotFoundError, match="not a drafter folder"):
        load_drafter("/nonexistent/drafter")


def test_rl_run_trains_the_drafter_online_and_resumes_it(tmp_path):
    from tailrl.rl.run import train
    from tailrl.rl.trainer import Trainer
    from tailrl.model.tiny import make_tiny_chat_model
    from tests.rl_helpers import tiny_cfg

    model_dir = str(make_tiny_chat_model(tmp_path / "m"))
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} + {i} =", "answer": str(2 * i)}) for i in range(32)))
    # mode learned: the head drafts every step (auto may decode plainly throughout, as it chose in one full-suite run)
    # at most 8 of the 32 sequences run at once: every step is in the long tail (engine/tail.py), where the spot
    # trainer gets threads (the tiny model's responses all run to max_tokens together, which leaves no tail)
    extra = ["drafter.enabled=true", "drafter.draft_vocab=0", "rollout.max_num_seqs=8", "drafter.spot_share=1.0",
             "drafter.batch_tokens=64", "rollout.max_tokens=12", "rollout.spec.mode=learned"]
    out = train(tiny_cfg(model_dir, str(data), tmp_path / "run", "trainer.steps=2", *extra))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["drafter/train_steps"] > 0 and "drafter/top1_acc" in last and "drafter/loss" in last
    assert any(k.startswith("spec/accept_length/") for k in last)
    ckpt = out / "checkpoints" / "step_000002" / "drafter"
    assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
    resumed = Trainer(tiny_cfg(model_dir, str(data), tmp_path / "run", "trainer.steps=3", "trainer.resume=true", *extra))
    assert resumed.resume() and resumed.step == 2
    saved = load_drafter(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(saved.fc.state_dict().values(), resumed.head.fc.state_dict().values()))
    assert resumed.drafter_trainer.steps == last["drafter/train_steps"]
    resumed.rewards.close()


def test_cli_drafter_train_then_generate_with_it(tmp_path, capsys):
    from tailrl.cli import main
    from tailrl.model.tiny import make_tiny_chat_model

    model_dir = str(make_tiny_chat_model(tmp_path / "m"))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} + {i} ="}) for i in range(12)) + "\n{bad json\n")
    out = tmp_path / "drafter"
    assert main(["drafter", "train", "--model", model_dir, "--data", str(data), "--out", str(out), "--n", "2",
                 "--max-tokens", "8", "--epochs", "2", "--batch-tokens", "32", "--draft-vocab", "0", "--quiet"]) == 0
    report = capsys.readouterr().out
    assert "eval_after" in report and (out / "model.safetensors").is_file()
    assert main(["generate", "--model", model_dir, "--prompts", str(data), "--spec", "learned", "--drafter", str(out),
                 "--max-tokens", "8", "--temperature", "0", "--out", str(tmp_path / "gen.jsonl"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert sum(r["finish_reason"] != "error" for r in rows) == 12 and rows[-1]["finish_reason"] == "error"
    assert sum(r["spec"].get("drafted/learned", 0) for r in rows if r["finish_reason"] != "error") > 0


def test_cli_drafter_errors_name_the_problem(tmp_path, capsys):
    from tailrl.cli import main

    assert main(["drafter", "train", "--model", str(tmp_path / "missing"), "--data", "arithmetic", "--limit", "2"]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["drafter", "export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "not a drafter folder" in capsys.readouterr().err
    assert main(["generate", "--spec", "learned", "--quiet", "--out", str(tmp_path / "g.jsonl")]) == 2
    assert "--drafter" in capsys.readouterr().err
