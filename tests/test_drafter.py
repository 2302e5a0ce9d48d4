import itertools
import json
import random
import threading
import time

import pytest
import torch

from tailrl.drafter import DrafterConfig, EagleDrafter, load_drafter, make_speculator, save_drafter
from tailrl.drafter.buffer import DraftBuffer
from tailrl.drafter.offline import collect, split, train_epochs
from tailrl.drafter.propose import LearnedDrafter
from tailrl.drafter.train import DrafterTrainer, SpotTrainer
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.spec.config import SpecConfig
from tests.stats import chisquare_pvalue
from tests.helpers import CHATS, assert_same_or_tie, exact_joint


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from tailrl.model import load_model
    from tests.conftest import make_tiny_chat_model

    return load_model(str(make_tiny_chat_model(tmp_path_factory.mktemp("tinylm"))), device="cpu", dtype=torch.float32)


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
            selector.choose = lambda batch: next(turn)
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
    from tailrl.rl.data import chat_prompt
    from tailrl.rl.tasks import make_rows

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


def _tiny_buffer(model, tok, steps=(0, 1)) -> DraftBuffer:
    buffer = DraftBuffer(max_tokens=100_000, steps=2)
    for step in steps:
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=0.2, capture_hidden=True, seed=step))
        buffer.add_completions(eng.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(n=4, max_tokens=12, seed=step, ignore_eos=True)), step)
    return buffer


def wait_for(cond, timeout: float = 120.0) -> bool:
    """Polls cond until it holds; the timeout only keeps a broken implementation from hanging the suite."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(cond())


def test_spot_training_pauses_promptly_and_never_touches_a_running_rollout(tiny_lm):
    """The spot trainer trains while a rollout drafts from the engine's head; a pause that lands in the first
    micro-batch of a step (of several) is acknowledged after that micro-batch: no further micro-batch runs, the
    partly accumulated step is dropped, and nothing trains after pause(wait=True) returns."""
    model, tok = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=1.0, spot_micro_tokens=16)
    head = EagleDrafter(model.config).bind(model)
    trainer = DrafterTrainer(head, cfg, buffer=_tiny_buffer(model, None))
    spot = SpotTrainer(trainer, cfg)
    spot.begin_step(1, last_step_s=1000.0)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    plain = Engine(model, None, EngineConfig(kv_cache_gb=0.2)).generate(prompts, params)
    spec = SpecConfig(mode="learned")
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.2, spec=spec), make_speculator(spec, LearnedDrafter(head, cfg)))
    rollout_done, paused = threading.Event(), threading.Event()
    seen = {"micro": 0, "step": -1}

    def pause_in_a_step(module, args):  # runs in the trainer's thread at the start of each micro-batch's forward
        seen["micro"] += 1
        first, seen["step"] = trainer.steps != seen["step"], trainer.steps
        if first and rollout_done.is_set() and not paused.is_set():
            spot.pause(wait=False)
            seen["at"] = (seen["micro"], trainer.steps)
            paused.set()

    trainer.model.register_forward_pre_hook(pause_in_a_step)
    try:
        assert spot.resume()
        outs = eng.generate(prompts, params)  # drafting from `head` while the trainer updates its own copy
        rollout_done.set()
        assert paused.wait(120) and spot.pause(wait=True, timeout=120)
        micro, steps = seen["at"]
        assert steps > 0 and sum(s.train_positions for s in trainer.buffer.items) > 2 * 16  # steps of several micro-batches
        assert seen["micro"] == micro, "a micro-batch ran after the pause"
        assert trainer.steps == steps, "the step in progress at the pause was not dropped"
        time.sleep(0.3)
        assert (seen["micro"], trainer.steps) == (micro, steps), "the spot trainer kept training after pause()"
    finally:
        spot.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items()), "the engine's head changed mid-rollout"
    trainer.publish(head)
    assert not all(torch.equal(before[k], v) for k, v in head.state_dict().items()), "publish copied nothing"


def test_spot_trainer_respects_its_time_share(tiny_lm):
    """A clock in which each optimizer step takes 0.25 s: a share of 1 s (0.1 of a 10 s RL step) is 4 steps, the
    trainer stops before a fifth would run over it, and the next RL step brings a new share."""
    model, _ = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=0.1)
    trainer = DrafterTrainer(EagleDrafter(model.config).bind(model), cfg, buffer=_tiny_buffer(model, None))
    spot = SpotTrainer(trainer, cfg, clock=lambda: 0.25 * trainer.steps)
    spot.begin_step(1, last_step_s=10.0)
    try:
        assert spot.resume()
        assert wait_for(lambda: not spot.running), "the spot trainer did not stop at its share"
        assert trainer.steps == 4 and spot.steps_this_rl_step == 4 and spot.used_s == 1.0, (trainer.steps, spot.used_s)
        assert not spot.resume(), "the share is spent until the next step"
        spot.begin_step(2, last_step_s=10.0)
        assert spot.resume(), "a new step brings a new share"
        assert wait_for(lambda: not spot.running) and trainer.steps == 8 and spot.used_s == 1.0
    finally:
        spot.close()


def test_buffer_one_step_offset_sampling_and_bound(tiny_lm):
    model, _ = tiny_lm
    buffer = _tiny_buffer(model, None, steps=(0, 1, 2))
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
    with pytest.raises(ConfigError, match="unknown config key 'drafter.nope'"):
        load_config(None, ["drafter.nope=1"])
    with pytest.raises(FileNotFoundError, match="not a drafter folder"):
        load_drafter("/nonexistent/drafter")


def test_concurrent_rollout_and_spot_thread_do_not_deadlock(tiny_lm):
    """The engine hook path (rl/trainer.py's rollout): a rollout steps the engine and lends the long tail to the spot
    trainer, while another thread pauses the trainer 5 times, each while a micro-batch runs. No pause hangs, and
    the rollouts finish with the tokens of plain decoding."""
    from tailrl.drafter.train import SpotLender

    model, _ = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=1.0, spot_micro_tokens=16)
    head = EagleDrafter(model.config).bind(model)
    trainer = DrafterTrainer(head, cfg, buffer=_tiny_buffer(model, None))
    spot = SpotTrainer(trainer, cfg)
    threads = torch.get_num_threads()
    lender = SpotLender(spot, trainer.buffer, cfg, tail_batch=64, threads=max(threads, 2))
    prompts, params = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    plain = Engine(model, None, EngineConfig(kv_cache_gb=0.2)).generate(prompts, params)
    spec = SpecConfig(mode="learned")
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.2, spec=spec), make_speculator(spec, LearnedDrafter(head, cfg)))
    in_rollout, results, started = threading.Event(), [], [0]
    trainer.model.register_forward_pre_hook(lambda module, args: started.__setitem__(0, started[0] + 1))

    def pauser():  # each pause once a micro-batch has begun since the last one
        for _ in range(5):
            mark = started[0]
            if not wait_for(lambda: spot.running and started[0] > mark):
                return
            results.append((in_rollout.is_set(), spot.pause(wait=True, timeout=10)))

    def rollouts():  # rollouts until the 5 pauses are done; a hang here leaves the thread alive, failing the test
        while pausing.is_alive() and len(outs) < 500:
            col = eng.collector(eng.add_requests(prompts, params))
            in_rollout.set()
            try:
                while eng.has_work():
                    out = eng.step()
                    col.add(out)
                    lender.on_engine_step(eng.num_running, out.finished)
            finally:
                in_rollout.clear()
                lender.stop()
            outs.append([o.token_ids for o in col.result()])

    outs: list = []
    pausing = threading.Thread(target=pauser, daemon=True)
    rolling = threading.Thread(target=rollouts, daemon=True)
    try:
        lender.begin_step(1, 1000.0)
        pausing.start()
        rolling.start()
        pausing.join(300)
        rolling.join(120)
        assert not pausing.is_alive() and not rolling.is_alive(), "a pause or a rollout hung"
        assert len(results) == 5 and all(ok for _, ok in results) and any(mid for mid, _ in results), results
        assert outs and all(o == [c.token_ids for c in plain] for o in outs)
    finally:
        spot.close()
        torch.set_num_threads(threads)


def test_rl_run_trains_the_drafter_online_and_resumes_it(tmp_path):
    from tailrl.rl.run import train
    from tailrl.rl.trainer import Trainer
    from tests.conftest import make_tiny_chat_model
    from tests.rl_helpers import tiny_cfg

    model_dir = str(make_tiny_chat_model(tmp_path / "m"))
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} + {i} =", "answer": str(2 * i)}) for i in range(32)))
    # mode learned: the head drafts every step (auto may decode plainly throughout, as it chose in one full-suite run)
    extra = ["drafter.enabled=true", "drafter.draft_vocab=0", "drafter.spot_batch=64", "drafter.spot_share=1.0",
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
    from tests.conftest import make_tiny_chat_model

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


def test_threads_lent_to_the_spot_trainer_come_back_when_it_stops_itself():
    """Once the spot trainer has spent its share mid-tail, the rollout gets its threads back at the next step."""
    from tailrl.drafter.train import SpotLender

    class StubSpot:
        running = False

        def resume(self):
            self.running = True
            return True

        def pause(self, wait=True, timeout=None):
            self.running = False
            return True

    before = torch.get_num_threads()
    lender = SpotLender(StubSpot(), DraftBuffer(), DrafterConfig(), tail_batch=4, threads=2)
    try:
        lender.on_engine_step(2, [])  # the long tail: threads lent
        assert lender.lent and torch.get_num_threads() == 1
        lender.spot.running = False  # the trainer spent its share and stopped by itself
        lender.on_engine_step(2, [])
        assert not lender.lent and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
