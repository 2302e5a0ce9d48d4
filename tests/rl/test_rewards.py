import time

import pytest

from tailrl.rl.rewards.runner import RewardRunner
from tailrl.rl.rewards.builtin import (accuracy_name, answers_match, countdown_reward, extract_answer, format_reward,
                               math_partial_reward, math_reward, math_strict_reward)
from tailrl.tasks import make_rows


def test_extract_answer_forms():
    assert extract_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_answer("#### 1\nwait\n#### 12 apples") == "12 apples"
    assert extract_answer(r"the answer is \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer("no answer here") is None


def test_numeric_and_symbolic_equivalence():
    assert answers_match("1,200", "1200")
    assert answers_match("$12.0", "12")
    assert answers_match("3/4", "0.75")
    assert answers_match(r"\frac{1}{2}", "0.5")
    assert not answers_match("13", "12")


def test_math_and_format_rewards():
    assert math_reward("... #### 42", "42") == 1.0
    assert math_reward("... #### 41", "42") == 0.0
    assert math_reward("42", "42") == 0.0  # no answer line
    assert format_reward("#### 41") == 1.0 and format_reward("41") == 0.0
    assert format_reward("9 + 2 = 11\n#### 11.") == 1.0 and format_reward("\\boxed{4}") == 1.0
    # gamed forms seen in a run: an equation after ####, several answer lines, text after the answer line
    for bad in ["#### 9 + 2 = 17", "#### 2\n#### 3", "#### 41\nmore text", "####", "#### five"]:
        assert format_reward(bad) == 0.0, bad
    assert math_partial_reward("so 5 + 7 = 12.", "12") == 0.5  # right, without the answer line
    assert math_partial_reward("#### 11", "12") == 0.0 and math_partial_reward("x #### 12", "12") == 1.0
    assert math_partial_reward("12 then #### 11", "12") == 0.0  # the answer line decides when present


def test_math_strict_pays_one_answer_line_only():
    spam = "6 + 1 = 7\n#### 6 + 1 = 7\n#### 1 = 1\n#### 7 = 7"  # the long preset's policy under `math`, step 1
    assert math_reward(spam, "7") == 1.0 and math_strict_reward(spam, "7") == 0.0
    assert math_strict_reward("6 + 1 = 7\n#### 7", "7") == 1.0 and math_strict_reward("#### 8", "7") == 0.0
    assert accuracy_name("auto", ["math_strict"]) == "math_strict" and accuracy_name("auto", ["math"]) == "math"
    with pytest.raises(ValueError, match="math_strict"):
        accuracy_name("mathh", ["math"])


def test_countdown_verifier():
    assert countdown_reward("#### (3 + 5) * 2", "16", numbers=[3, 5, 2]) == 1.0
    assert countdown_reward("#### 3 * 5 + 2 = 17", "17", numbers=[3, 5, 2]) == 1.0
    assert countdown_reward("#### 8 * 2", "16", numbers=[3, 5, 2]) == 0.0  # numbers not used exactly once
    assert countdown_reward("#### __import__('os')", "1", numbers=[1]) == 0.0


def test_generated_tasks_are_solvable_and_spread():
    rows = make_rows("arithmetic", 400, seed=0)
    assert {r["level"] for r in rows} == {1, 2, 3, 4}
    assert all(math_reward(f"#### {r['answer']}", r["answer"]) == 1.0 for r in rows)
    cd = make_rows("countdown", 50, seed=0)
    assert all(r["numbers"] and r["answer"] for r in cd)
    with pytest.raises(ValueError, match="unknown task"):
        make_rows("sudoku", 1)


def raises_on_seven(prompts, completions, answer, **_):
    if any("7" in c for c in completions):
        raise RuntimeError("boom")
    return [1.0 for _ in completions]


def hangs_on_seven(prompts, completions, answer, **_):
    if any("7" in c for c in completions):
        time.sleep(60)
    return [0.5 for _ in completions]


def test_raising_and_hanging_user_rewards_give_zero_and_go_on():
    """A raising sample fails alone; a hanging batch gets 0 for this step (one timeout, no per-sample retries)."""
    runner = RewardRunner(["tests.rl.test_rewards:raises_on_seven", "tests.rl.test_rewards:hangs_on_seven"], timeout_s=3)
    try:
        rewards, stats = runner(["p"] * 3, ["#### 1", "#### 7", "#### 3"], {"answer": ["1", "7", "3"]})
        assert rewards == [1.0, 0.0, 1.0]
        assert stats.errors == 1 and stats.timeouts == 3
        rewards, stats = runner(["p"] * 2, ["#### 1", "#### 3"], {"answer": ["1", "3"]})  # a new worker goes on
        assert rewards == [1.5, 1.5] and stats.errors == stats.timeouts == 0
    finally:
        runner.close()


def test_unknown_reward_function_is_named_at_start():
    with pytest.raises(ValueError, match="no_such_module"):
        RewardRunner(["no_such_module:f"])
    with pytest.raises(ValueError, match="weights"):
        RewardRunner(["math"], [1.0, 2.0])


def test_overlong_penalty_at_the_windows_edges():
    """DAPO eq. 13 with L_max = 96, L_cache = 16, penalty 0.5: 0 up to 80 tokens, -0.5/16 at 81, -0.5 at 96 (and
    beyond); buffer 0 is off."""
    from tailrl.rl.rewards.overlong import overlong_penalty

    assert overlong_penalty(0, 96, 16, 0.5) == 0.0 and overlong_penalty(80, 96, 16, 0.5) == 0.0
    assert overlong_penalty(81, 96, 16, 0.5) == pytest.approx(-0.5 / 16)
    assert overlong_penalty(88, 96, 16, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(96, 96, 16, 0.5) == pytest.approx(-0.5) and overlong_penalty(97, 96, 16, 0.5) == -0.5
    assert overlong_penalty(96, 96, 0, 0.5) == 0.0


def overlong_scores(overrides, lengths, group_size):
    """Rewarder.score of responses that are all right ('#### 1' for answer 1) with the given token lengths."""
    from types import SimpleNamespace

    from tailrl.config import load_config
    from tailrl.rl.data import Example
    from tailrl.rl.rewards.rewarder import Rewarder

    rewarder = Rewarder(load_config(None, ["rollout.max_tokens=10", *overrides]))
    try:
        comps = [SimpleNamespace(prompt_index=0, text="#### 1", token_ids=[5] * n) for n in lengths]
        return rewarder.score([Example(prompt="p", answer="1")], comps, group_size)
    finally:
        rewarder.close()


def test_overlong_term_joins_training_rewards_only_and_has_its_metrics():
    lengths = [3, 6, 7, 10]  # L_max 10, L_cache 4: the term is below 0 from 7 tokens
    rewards, m, correct = overlong_scores(["reward.overlong_buffer=4", "reward.overlong_penalty=2"], lengths, 4)
    assert rewards.tolist() == pytest.approx([1.0, 1.0, 1 - 2 / 4, 1 - 2.0])
    assert m["reward/overlong/mean"] == pytest.approx(-2.5 / 4) and m["reward/overlong/frac"] == 0.5
    assert m["reward/mean"] == pytest.approx(float(rewards.mean())) and correct == [True] * 4
    # eval (group_size 1) and the default (off): the answers' rewards alone, no overlong metric
    for overrides, g in ((["reward.overlong_buffer=4"], 1), ([], 4)):
        rewards, m, _ = overlong_scores(overrides, lengths, g)
        assert rewards.tolist() == [1.0] * 4 and not any("overlong" in k for k in m)


def test_overlong_term_keeps_truncated_responses_masked():
    """With algo.mask_truncated the cut response (at the cap: the full -penalty) still leaves the update; the term
    only shapes its siblings' advantages."""
    from types import SimpleNamespace

    from tailrl.rl.actor.forward import make_batch, mask_truncated
    from tailrl.rl.algos import group_advantages

    lengths = [3, 8, 10, 4]
    rewards, _, _ = overlong_scores(["reward.overlong_buffer=4", "algo.mask_truncated=true"], lengths, 4)
    comps = [SimpleNamespace(prompt_token_ids=[7, 8], token_ids=[5] * n, logprobs=[-1.0] * n) for n in lengths]
    batch = make_batch(comps, pad=0)
    adv = mask_truncated(batch, group_advantages(rewards, 4), [n == 10 for n in lengths])
    assert adv[2] == 0 and batch.mask[2].sum() == 0
    assert adv[0] > 0 and adv[1] < 0  # the 8-token response pays -0.5 (window 7..10) against the short ones


@pytest.mark.parametrize("override, message", [
    ("reward.overlong_buffer=96", "below rollout.max_tokens (96)"),
    ("reward.overlong_buffer=-1", "reward.overlong_buffer"),
    ("reward.overlong_penalty=-0.5", "reward.overlong_penalty"),
    ("reward.overlong_penalty=inf", "reward.overlong_penalty"),
])
def test_overlong_settings_are_checked(override, message):
    from tailrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])
