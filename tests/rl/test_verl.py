"""verl's datasets as they are: files built the way verl's preprocessing scripts build them (gsm8k.py,
math_dataset.py, and a system-prompt variant), dotted column paths, and the `verl` reward routed by data_source."""

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tailrl.config import DataCfg, RewardCfg, load_config
from tailrl.rl.data import load_datasets, peek_rows
from tailrl.rl.rewards.runner import RewardRunner
from tailrl.rl.rewards.builtin import accuracy_verifier
from tailrl.rl.rewards.verl import adopt_verl, verl_reward

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # verl's math_dataset.py
MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def gsm8k_row(i: int, split: str, question: str, answer_raw: str) -> dict:
    """What verl's examples/data_preprocess/gsm8k.py writes for one GSM8K example."""
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", answer_raw).group(1).replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": i, "answer": answer_raw, "question": question}}


def math_row(i: int, split: str, problem: str, boxed: str, source: str, system: bool) -> dict:
    """verl's math_dataset.py (instruction after the problem), or the system-prompt variant of DAPO-style recipes."""
    prompt = ([{"role": "system", "content": MATH_SYSTEM}, {"role": "user", "content": problem}] if system
              else [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}])
    return {"data_source": source, "prompt": prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": boxed}, "extra_info": {"split": split, "index": i}}


def write_parquet(rows: list[dict], path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def gsm8k_files(folder, n_train=24, n_test=8, answer="7"):
    def rows(split, n):
        return [gsm8k_row(i, split, f"Ann has {i} apples and gets some more. How many?",
                          f"She has {i} + 1 = <<{i}+1={i + 1}>>{i + 1}.\n#### {answer}") for i in range(n)]
    return write_parquet(rows("train", n_train), folder / "train.parquet"), write_parquet(rows("test", n_test),
                                                                                        folder / "test.parquet")


def math_files(folder, n_train=24, n_test=8, answer="7"):
    sources = ["DigitalLearningGMU/MATH-lighteval", "HuggingFaceH4/MATH-500"]

    def rows(split, n):
        return [math_row(i, split, f"Find $x$ if $x - {i} = {7 - i}$.", answer, sources[i % 2], system=i % 3 == 0)
                for i in range(n)]
    return write_parquet(rows("train", n_train), folder / "train.parquet"), write_parquet(rows("test", n_test),
                                                                                        folder / "test.parquet")


def test_verl_files_load_as_they_are_with_their_columns(tmp_path):
    train_file, _ = gsm8k_files(tmp_path, n_train=6, answer="1,234".replace(",", ""))
    data, reward = DataCfg(train_file=train_file, num_eval=2), RewardCfg()
    notes = adopt_verl(data, reward, peek_rows(train_file))
    assert data.answer_key == "reward_model.ground_truth" and reward.functions == ["verl"] and data.system_prompt == ""
    assert any("verl's format" in n for n in notes) and any("reward: verl" in n for n in notes)
    train, evals = load_datasets(data)
    assert len(train) == 4 and len(evals) == 2
    ex = train[0]
    assert ex.answer == "1234" and ex.prompt[0]["role"] == "user" and GSM8K_INSTRUCTION in ex.prompt[0]["content"]
    assert ex.columns["data_source"] == "openai/gsm8k" and ex.columns["extra_info"]["split"] == "train"
    assert set(ex.columns) == {"data_source", "ability", "reward_model", "extra_info"}
    # a JSONL of the same rows, with the key given: a dotted path reaches into the nested column
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(gsm8k_row(i, "train", "q", "#### 5")) for i in range(4)))
    train, _ = load_datasets(DataCfg(train_file=str(tmp_path / "d.jsonl"), answer_key="reward_model.ground_truth",
                                     num_eval=1))
    assert [e.answer for e in train] == ["5"] * 3
    with pytest.raises(ValueError, match="no column 'reward_model.truth'"):
        load_datasets(DataCfg(train_file=str(tmp_path / "d.jsonl"), answer_key="reward_model.truth"))


def test_keys_set_by_the_user_are_kept(tmp_path):
    train_file, _ = gsm8k_files(tmp_path, n_train=4)
    data, reward = DataCfg(train_file=train_file, answer_key="extra_info.answer"), RewardCfg(functions=["format"])
    assert adopt_verl(data, reward, peek_rows(train_file)) == []
    assert data.answer_key == "extra_info.answer" and reward.functions == ["format"]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "q", "answer": 1}) + "\n")
    data = DataCfg(train_file=str(plain))
    assert adopt_verl(data, RewardCfg(), peek_rows(str(plain))) == [] and data.answer_key == "answer"


def test_verl_reward_routes_by_data_source():
    gsm8k, math500, dapo = "openai/gsm8k", "HuggingFaceH4/MATH-500", "math_dapo"
    assert verl_reward("so it is 72.\n#### 72", "72", data_source=gsm8k) == 1.0
    assert verl_reward("#### 1,234", "1234", data_source=gsm8k) == 1.0
    assert verl_reward("the answer is \\boxed{72}", "72", data_source=gsm8k) == 0.0  # strict: '####' only
    assert verl_reward("#### 71", "72", data_source=gsm8k) == 0.0
    assert verl_reward("so \\boxed{\\frac{1}{2}}", "\\frac12", data_source=math500) == 1.0  # math-verify equivalence
    assert verl_reward("\\boxed{0.5}", "\\frac{1}{2}", data_source="lighteval/MATH") == 1.0
    assert verl_reward("#### 0.5", "\\frac{1}{2}", data_source="DigitalLearningGMU/MATH-lighteval") == 0.0  # boxed only
    assert verl_reward("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", data_source=math500) == 0.0
    assert verl_reward("work...\nAnswer: 34", "34", data_source=dapo) == 1.0
    assert verl_reward("\\boxed{34}", "34", data_source="BytedTsinghua-SIA/DAPO-Math-17k") == 1.0
    with pytest.raises(ValueError, match="'my/source'"):
        verl_reward("#### 1", "1", data_source="my/source")


def test_an_unknown_source_is_counted_not_a_crash(caplog):
    runner = RewardRunner(["verl"], max_failed_steps=3)
    comps = ["#### 7", "#### 7", "\\boxed{7}"]
    cols = {"answer": ["7"] * 3, "data_source": ["openai/gsm8k", "nobody/knows", "lighteval/MATH"]}
    with caplog.at_level(logging.WARNING):
        total, st = runner([None] * 3, comps, cols)
    assert total == [1.0, 0.0, 1.0] and st.errors == 1
    assert "'nobody/knows'" in caplog.text and caplog.text.count("reward verl raised") == 1
    verifier = accuracy_verifier("auto", ["verl"])
    assert [verifier(c, answer="7", data_source=s) for c, s in zip(comps, cols["data_source"])] == [True, False, True]


class RewardSpy:
    """Wraps RewardRunner.__call__: records what was scored and what it got, changing nothing."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = RewardRunner.__call__

        def spy(runner, prompts, completions, columns):
            total, stats = original(runner, prompts, completions, columns)
            self.calls.append((runner.names, list(completions), dict(columns), list(total)))
            return total, stats
        monkeypatch.setattr(RewardRunner, "__call__", spy)


def expected(text: str, answer: str, source: str) -> float:
    """The rule verl applies to each source, written here independently of tailrl.rl.rewards.verl."""
    if source == "openai/gsm8k":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return float(bool(found) and found[-1].replace(",", "") == answer)
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return float(bool(boxed) and boxed[-1].strip() == answer)


# the model writes whole answers as single words, so that both rules fire often enough to tell them apart
WORDS = ["<pad>", "<s>", "<eos>", "<|user|>", "<|assistant|>", "?", "#### 7", "\\boxed{7}", "7", "so"]


@pytest.mark.parametrize("files", [gsm8k_files, math_files])
def test_train_on_verl_parquet_as_it_is(files, tmp_path, monkeypatch, capsys):
    from tailrl.cli import main
    from tailrl.model.tiny import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "m", words=WORDS)
    train_file, test_file = files(tmp_path)
    spy = RewardSpy(monkeypatch)
    out = tmp_path / "run"
    rc = main(["train", f"data.train_file={train_file}", f"data.eval_file={test_file}", f"model.path={model}",
               "trainer.steps=2", f"trainer.out_dir={out}", "rollout.kv_cache_gb=0.1", "trainer.report=false"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "verl's format" in printed and "reward: verl" in printed
    scored = [(c, a, s, t) for names, comps, cols, total in spy.calls
              for c, a, s, t in zip(comps, cols["answer"], cols["data_source"], total)]
    assert all(names == ["verl"] for names, *_ in spy.calls) and len(scored) >= 2 * 8 * 8
    assert {"extra_info", "ability"} <= set(spy.calls[0][2])  # verl's columns reach reward functions
    for text, answer, source, total in scored:
        assert total == expected(text, answer, source), (source, text)
    # the rules differ on these samples: a gsm8k row pays only '#### 7', a MATH row only '\boxed{7}'
    other = "lighteval/MATH" if files is gsm8k_files else "openai/gsm8k"
    assert any(expected(c, a, other) != t for c, a, _, t in scored)
    assert any(t == 1.0 for *_, t in scored)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[0] and "reward/verl/mean" in rows[1]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["data"]["answer_key"] == "reward_model.ground_truth" and cfg["reward"]["functions"] == ["verl"]
    assert load_config(None, [f"data.train_file={train_file}"]).data.answer_key == "answer"  # only a run adopts
