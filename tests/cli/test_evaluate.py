"""`tailrl eval`: the estimators, and on a tiny run: greedy pass@1 equals the run's last eval/accuracy (from the run
folder, its checkpoint folder and the HF folder inside it), n samples give pass@k/maj@k that agree with the JSONL."""

import itertools
import json
import re

import pytest
import torch

from tailrl.cli import main
from tailrl.rl.evaluate import majority_correct, pass_at_k

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

SEVENS = {1, 4, 6, 11, 13}  # rows 0-15 (the run's held-out rows): 5 answers '7', 11 answers '3'
WORDS = ["<pad>", "<s>", "<eos>", "<|user|>", "<|assistant|>", "?", *"0123456789", "+", "=", "#### 3", "#### 7"]


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (8, 2), (8, 8)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_majority_vote():
    assert majority_correct(["#### 5", "so #### 5", "#### 6"], [False, False, True]) is False
    assert majority_correct(["#### 1,000", "#### 1000.", "\\boxed{7}"], [True, True, False]) is True  # same answer
    assert majority_correct(["#### 6", "#### 5"], [True, False]) is True  # a tie: the answer seen first
    assert majority_correct(["no answer", "none"], [False, False]) is False


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step run of a tiny model that answers '#### 3' or '#### 7' (so greedy accuracy is 5/16 or 11/16)."""
    from safetensors.torch import load_file, save_file

    from tailrl.model.tiny import make_tiny_chat_model

    root = tmp_path_factory.mktemp("evalrun")
    model = make_tiny_chat_model(root / "m", words=WORDS)
    sd = load_file(str(model / "model.safetensors"))
    v = torch.randn(sd["model.embed_tokens.weight"].shape[1], generator=torch.Generator().manual_seed(0))
    sd["model.embed_tokens.weight"][WORDS.index("#### 3")] = v  # one of the two answer lines wins every argmax
    sd["model.embed_tokens.weight"][WORDS.index("#### 7")] = -v
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    rows = [{"prompt": f"{i % 10} + {(i * 3) % 7} =", "answer": "7" if i in SEVENS or (i >= 16 and i % 2) else "3"}
            for i in range(48)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = root / "run"
    assert main(["train", f"model.path={model}", f"data.train_file={root / 'train.jsonl'}", "data.num_eval=16",
                 f"trainer.out_dir={run}", "rollout.n=4", "rollout.max_tokens=8", "trainer.prompts_per_step=4",
                 "trainer.steps=2", "trainer.eval_every=1", "rollout.kv_cache_gb=0.1", "trainer.report=false",
                 "algo.lr=0.02"]) == 0
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in x][-1]
    assert last["step"] == 2 and last["eval/accuracy"] in (5 / 16, 11 / 16)
    return root, run, last["eval/accuracy"]


def printed(text: str, key: str) -> float:
    return float(re.search(rf"{re.escape(key)} ([0-9.]+)", text).group(1))


def test_greedy_pass_at_1_is_the_runs_eval_accuracy(tiny_run, capsys):
    root, run, accuracy = tiny_run
    ckpt = run / "checkpoints" / "step_000002"
    for source, extra in ((run, []), (ckpt, []), (ckpt / "model", ["--data", str(root / "train.jsonl"), "--limit", "16",
                                                                     "--max-tokens", "8"])):
        out = root / "greedy.jsonl"
        assert main(["eval", str(source), "--out", str(out), *extra]) == 0, source
        text = capsys.readouterr().out
        assert printed(text, "pass@1") == pytest.approx(accuracy, abs=1e-3), (source, text)
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 16 and sum(r["correct"] for r in rows) / 16 == accuracy
        assert all(r["finish_reason"] == "length" and r["length"] == 8 for r in rows)
    assert "the run's eval/accuracy at step 2 (greedy)" in text or source == ckpt / "model"


def test_n_samples_give_pass_at_k_and_maj_at_k_from_the_completions(tiny_run, capsys):
    root, run, _ = tiny_run
    out = root / "sampled.jsonl"
    assert main(["eval", str(run), "--n", "4", "--temperature", "1.0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 16 * 4 and {r["sample"] for r in rows} == {0, 1, 2, 3}
    groups = [[r for r in rows if r["index"] == i] for i in range(16)]
    assert printed(text, "pass@1") == pytest.approx(sum(r["correct"] for r in rows) / 64, abs=1e-3)
    assert printed(text, "pass@4") == pytest.approx(sum(any(r["correct"] for r in g) for g in groups) / 16, abs=1e-3)
    assert printed(text, "pass@2") == pytest.approx(
        sum(pass_at_k(4, sum(r["correct"] for r in g), 2) for g in groups) / 16, abs=1e-3)
    maj = sum(majority_correct([r["completion"] for r in g], [r["correct"] for r in g]) for g in groups) / 16
    assert printed(text, "maj@4") == pytest.approx(maj, abs=1e-3)
    assert printed(text, "mean length") == pytest.approx(sum(r["length"] for r in rows) / 64, abs=0.05)
    assert "temperature 1" in text and "speculation auto" in text


def test_bad_sources_and_data_are_one_line_errors(tiny_run, tmp_path, capsys):
    root, run, _ = tiny_run
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "not found" in capsys.readouterr().err
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    assert main(["eval", str(empty)]) == 2
    assert "has no checkpoint yet" in capsys.readouterr().err
    assert main(["eval", str(run), "--data", "arithmatic"]) == 2
    err = capsys.readouterr().err
    assert "'arithmatic': not a file, nor a built-in task (arithmetic, countdown" in err  # the tasks it knows


def test_eval_on_a_verl_file_uses_the_verl_reward(tiny_run, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, run, _ = tiny_run
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i} + 1 = ? ####"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3" if i % 3 else "7"},
             "extra_info": {"split": "test", "index": i}} for i in range(9)]
    pq.write_table(pa.Table.from_pylist(rows), root / "gsm8k_test.parquet")
    out = root / "verl_eval.jsonl"
    model = run / "checkpoints" / "step_000002" / "model"  # a bare HF folder: nothing of the run's config
    assert main(["eval", str(model), "--data", str(root / "gsm8k_test.parquet"), "--max-tokens", "4",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reward: verl" in text and "(reward verl:" in text
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 9 and [r["answer"] for r in got] == [r["reward_model"]["ground_truth"] for r in rows]
    for r in got:  # gsm8k's strict rule: the last '#### <number>'
        last = re.findall(r"#### (\-?[0-9\.\,]+)", r["completion"])
        assert r["reward"] == float(bool(last) and last[-1] == r["answer"])
    assert printed(text, "pass@1") == pytest.approx(sum(r["correct"] for r in got) / 9, abs=1e-3)
