import json

import pytest

from tailrl.config import DataCfg
from tailrl.rl.data import Loader, load_datasets
from tailrl.tasks import chat_prompt


def test_jsonl_and_parquet_rows_with_extra_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "answer": i, "difficulty": i % 3} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"prompt": "x"}\n{bad\n')
    for name in ("d.parquet", "d.jsonl"):
        train, evals = load_datasets(DataCfg(train_file=str(tmp_path / name), num_eval=2))
        assert len(evals) == 2 and len(train) == 8  # the row without an answer and the bad line are skipped
        assert train[0].answer == "2" and train[0].columns == {"difficulty": 2}


def test_chat_messages_prompt_and_system_prompt():
    msgs = chat_prompt([{"role": "user", "content": "hi"}], "be brief")
    assert msgs[0] == {"role": "system", "content": "be brief"} and msgs[1]["content"] == "hi"
    assert chat_prompt("hi")[0] == {"role": "user", "content": "hi"}


def test_a_dataset_without_usable_rows_is_an_error(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"question": "no prompt key"}\n')
    with pytest.raises(ValueError, match="no usable rows"):
        load_datasets(DataCfg(train_file=str(tmp_path / "d.jsonl")))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_datasets(DataCfg(train_file=str(tmp_path / "missing.jsonl")))


def test_loader_reshuffles_per_epoch_and_resumes():
    a = Loader(8, seed=1)
    first = a.next(24)
    epochs = [first[:8], first[8:16], first[16:]]
    assert all(sorted(e) == list(range(8)) for e in epochs)  # each epoch is a permutation of the examples
    assert len({tuple(e) for e in epochs}) == 3  # in an order of its own
    b = Loader(8, seed=1)
    b.next(11)  # into the second epoch
    c = Loader(8, seed=1)
    c.load_state_dict(b.state_dict())
    assert c.next(9) == first[11:20]  # resumes mid-epoch, and the third epoch's order is the one a run would draw


def test_builtin_eval_prompts_are_held_out_and_distinct(monkeypatch):
    # level-1 arithmetic has only 81 distinct prompts, so plain sampling repeats them and leaks eval into train
    train, evals = load_datasets(DataCfg(task="arithmetic", num_train=300, num_eval=64, levels=[]))
    tp, ep = [e.prompt for e in train], [e.prompt for e in evals]
    assert len(train) == 300 and len(evals) == 64
    assert len(set(tp)) == 300 and len(set(ep)) == 64 and not set(tp) & set(ep)
    assert {e.columns["level"] for e in evals} == {1, 2, 3, 4}
    easy_train, easy_evals = load_datasets(DataCfg(task="arithmetic", num_train=40, num_eval=20, levels=[1, 2]))
    assert {e.columns["level"] for e in easy_train + easy_evals} == {1, 2}
    assert not {e.prompt for e in easy_train} & {e.prompt for e in easy_evals}
    from tailrl import tasks

    monkeypatch.setitem(tasks.TASKS, "five", lambda rng: {"prompt": str(rng.randint(1, 5)), "answer": "0", "level": 1})
    assert len(load_datasets(DataCfg(task="five", num_train=3, num_eval=2))[0]) == 3
    with pytest.raises(ValueError, match="only 3 distinct prompts of the 4"):
        load_datasets(DataCfg(task="five", num_train=4, num_eval=2))


def test_a_train_file_too_small_to_hold_out_eval_says_so(tmp_path, caplog):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(3)))
    with caplog.at_level("WARNING"):
        train, evals = load_datasets(DataCfg(train_file=str(tmp_path / "d.jsonl"), num_eval=4))
    assert len(train) == 3 and [e.prompt for e in evals] == [e.prompt for e in train]
    assert "not held out" in caplog.text and "data.num_eval=4" in caplog.text


def test_make_rows_keeps_the_asked_levels():
    from tailrl.tasks import make_rows

    rows = make_rows("arithmetic", 50, seed=3, levels=[3])
    assert len(rows) == 50 and {r["level"] for r in rows} == {3}
    assert {r["level"] for r in make_rows("arithmetic", 200, seed=3)} == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="levels \\[9\\]"):
        make_rows("arithmetic", 5, levels=[9])
