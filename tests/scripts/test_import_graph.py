"""The house's import graph (scripts/import_graph.py): no cycle between files or rooms, and no arrow up against the
order cli -> rl -> rollout -> {agent, cluster, config, drafter} -> engine -> speculative -> model (docs/design.md),
lazy imports inside functions included."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_tree_has_no_cycle_and_no_arrow_up():
    r = _graph().check(ROOT / "tailrl")
    assert r["file_cycles"] == []
    assert r["room_cycles"] == []
    assert r["arrows_up"] == []


def test_the_check_finds_a_lazy_cycle_and_an_arrow_up(tmp_path):
    pkg = tmp_path / "tailrl"
    for path, text in {"__init__.py": "", "model/__init__.py": "", "engine/__init__.py": "",
                       "model/a.py": "def f():\n    from ..engine import b\n",  # model -> engine: up, and lazy
                       "engine/b.py": "from tailrl.model import a\n",
                       "engine/c.py": "from . import d\n", "engine/d.py": "def g():\n    import tailrl.engine.c\n"}.items():
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).write_text(text)
    r = _graph().check(pkg)
    assert r["file_cycles"] == [["tailrl.engine.b", "tailrl.model.a"], ["tailrl.engine.c", "tailrl.engine.d"]]
    assert r["room_cycles"] == [["engine", "model"]]
    assert [(a, b) for a, b, _ in r["arrows_up"]] == [("model", "engine")]
