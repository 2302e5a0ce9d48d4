import json

import pytest

from tailrl.cli import main

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


def test_generate_writes_completions_and_isolates_bad_rows(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello"}\n{oops\n{"text": "no prompt key"}\n'
                       '{"prompt": [{"role": "user", "content": "2+2?"}]}\n')
    out = tmp_path / "o.jsonl"
    rc = main(["generate", "--prompts", str(prompts), "--out", str(out), "--n", "2", "--max-tokens", "6",
               "--temperature", "0", "--quiet"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8
    errors = {r["index"]: r["error"] for r in rows if r["finish_reason"] == "error"}
    assert set(errors) == {1, 2}
    assert ":2: not valid JSON" in errors[1] and "'prompt'" in errors[2]
    good = [r for r in rows if r["finish_reason"] != "error"]
    assert all(len(r["token_ids"]) == len(r["logprobs"]) > 0 for r in good)
    assert good[0]["token_ids"] == good[1]["token_ids"]  # greedy: both samples agree
    assert "row 1" in capsys.readouterr().err


def test_generate_reports_unknown_model_and_bad_values(capsys):
    assert main(["generate", "--model", "does-not-exist"]) == 2
    assert "does-not-exist" in capsys.readouterr().err
    assert main(["generate", "--temperature", "-1"]) == 2
    assert "temperature=-1" in capsys.readouterr().err
    assert main(["generate", "--backend", "vllm", "--spec", "history"]) == 2  # before any model or vLLM
    assert "--spec history is not a speculation of --backend vllm (auto, off, tailrl, ngram, suffix)" in \
        capsys.readouterr().err
    assert main(["generate", "--spec", "suffix"]) == 2
    assert "--spec suffix is not a speculation of --backend tailrl" in capsys.readouterr().err
