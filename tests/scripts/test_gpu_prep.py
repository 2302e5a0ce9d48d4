"""benchmarks/gpu/pieces.py, which carries vLLM's wheels to a lent GPU machine in pieces: split, add, join, checked."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

_PIECES = Path(__file__).parents[2] / "benchmarks" / "gpu" / "pieces.py"
_spec = importlib.util.spec_from_file_location("gpu_pieces", _PIECES)
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    rng = __import__("random").Random(0)
    for name, size in [("a-1.0-py3-none-any.whl", 5000), ("b-2.0-cp312-cp312-manylinux_2_28_x86_64.whl", 12345),
                       ("empty.txt", 0), ("c.tar.gz", 777)]:
        (d / name).write_bytes(bytes(rng.randrange(256) for _ in range(size)))
    return d


def test_split_add_join_round_trip(src, tmp_path):
    m = gp.split(src, tmp_path / "parts", piece_bytes=4096)
    parts = sorted((tmp_path / "parts").glob("part_*"))
    assert len(parts) == len(m["pieces"]) > 4 and all(p["bytes"] <= 4096 for p in m["pieces"])
    assert all(json.loads((p / "manifest.json").read_text()) == m for p in parts)
    store = tmp_path / "store"
    for i, part in enumerate(parts):  # one part a call, as on the device
        have, missing = gp.add(part, store)
        assert len(have) == i + 1 and len(missing) == len(parts) - i - 1
    files = gp.join(store, tmp_path / "dest")
    assert sorted(f.name for f in files) == sorted(p.name for p in src.iterdir())
    for f in files:
        assert f.read_bytes() == (src / f.name).read_bytes()


def test_join_refuses_missing_swapped_or_altered_pieces(src, tmp_path):
    gp.split(src, tmp_path / "parts", piece_bytes=4096)
    store = tmp_path / "store"
    gp.add(tmp_path / "parts", store)  # every part folder under it
    (store / "piece_02").rename(tmp_path / "p2")
    with pytest.raises(SystemExit, match="piece_02: missing"):
        gp.join(store, tmp_path / "dest")
    (tmp_path / "p2").rename(store / "piece_02")
    a, b = (store / "piece_01").read_bytes(), (store / "piece_02").read_bytes()
    (store / "piece_01").write_bytes(b)
    (store / "piece_02").write_bytes(a)
    with pytest.raises(SystemExit, match="sha256 differs"):
        gp.join(store, tmp_path / "dest")
    # pieces that each match the manifest but join into another tar (a manifest edited to match swapped pieces)
    man = json.loads((store / "manifest.json").read_text())
    man["pieces"][0]["sha256"], man["pieces"][1]["sha256"] = man["pieces"][1]["sha256"], man["pieces"][0]["sha256"]
    (store / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(SystemExit, match="joined tar's sha256"):
        gp.join(store, tmp_path / "dest")


def test_add_refuses_a_damaged_piece_and_another_preparation(src, tmp_path):
    gp.split(src, tmp_path / "parts", piece_bytes=4096)
    part = tmp_path / "parts" / "part_01"
    good = (part / "piece_01").read_bytes()
    (part / "piece_01").write_bytes(b"x" + good[1:])
    with pytest.raises(SystemExit, match="damaged"):
        gp.add(part, tmp_path / "store")
    (part / "piece_01").write_bytes(good)
    gp.add(part, tmp_path / "store")
    (src / "a-1.0-py3-none-any.whl").write_bytes(b"another wheel")
    gp.split(src, tmp_path / "parts2", piece_bytes=4096)
    with pytest.raises(SystemExit, match="another preparation"):
        gp.add(tmp_path / "parts2" / "part_01", tmp_path / "store")


def test_split_follows_a_link_and_plans_calls(src, tmp_path):
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(src / "c.tar.gz", linked / "model.gguf")
    gp.split(linked, tmp_path / "gguf", piece_bytes=500)
    gp.add(tmp_path / "gguf", tmp_path / "gstore")
    (f,) = gp.join(tmp_path / "gstore", tmp_path / "gdest")
    assert not f.is_symlink() and f.read_bytes() == (src / "c.tar.gz").read_bytes()
    gp.split(src, tmp_path / "parts", piece_bytes=4096)
    calls = gp.plan_calls([tmp_path / "parts", tmp_path / "gguf"], limit_bytes=14000)
    parts = sorted(list((tmp_path / "parts").glob("part_*")) + list((tmp_path / "gguf").glob("part_*")))
    assert sorted(p for c in calls for p in c) == parts  # each part in exactly one call
    assert all(sum(f.stat().st_size for p in c for f in p.iterdir()) <= 14000 for c in calls)
    assert len(calls) < len(parts)  # parts share calls where they fit
