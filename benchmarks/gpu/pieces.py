"""A folder of files carried to a lent GPU machine in pieces of at most 60 MiB, one per device call (a call carries
at most 64 MiB): benchmarks/gpu/vllm.sh's carrier for vLLM's wheels and the SmolLM2 GGUF. Standard library only:
the device's Python runs `add` and `join`.

    python benchmarks/gpu/pieces.py split SRC DIR [--piece-mib 60]  # SRC's files -> DIR/part_NN/{piece_NN,manifest.json}
    python benchmarks/gpu/pieces.py add DIR STORE      # copy the pieces found under DIR (or DIR itself) into STORE
    python benchmarks/gpu/pieces.py join STORE DEST    # all pieces there: join, check, unpack into DEST, check
    python benchmarks/gpu/pieces.py calls DIR...       # the part folders grouped into device calls of <= 61 MiB

`split` packs SRC's files into one uncompressed tar (wheels are zips already) and cuts it into pieces; every part
folder holds one piece and the same manifest (sha256 and size of each piece, of the whole tar and of each file), so
whichever part arrives first tells the device what else to wait for. `add` refuses a piece whose sha256 differs from
the manifest and a store that holds another preparation's pieces. `join` fails (exit 1) on a missing or altered
piece, a joined tar whose sha256 differs, a tar holding other names than the manifest's, or an unpacked file whose
size or sha256 differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

MIB = 1 << 20
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split(src: Path, dst: Path, piece_bytes: int = 60 * MIB) -> dict:
    """SRC's regular files (sorted, flat) -> DST/part_NN/{piece_NN, manifest.json}; returns the manifest."""
    files = sorted(p for p in src.iterdir() if p.is_file())
    if not files:
        raise SystemExit(f"split: no files in {src}")
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("part_*"):
        shutil.rmtree(old)
    bundle = dst / "bundle.tar"
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            info = tarfile.TarInfo(p.name)  # a regular file even where SRC holds a link to it
            info.size, info.mode = p.stat().st_size, 0o644
            with open(p, "rb") as f:
                tar.addfile(info, f)
    manifest = {"bundle": {"sha256": sha256(bundle), "bytes": bundle.stat().st_size},
                "files": [{"name": p.name, "sha256": sha256(p), "bytes": p.stat().st_size} for p in files],
                "pieces": []}
    with open(bundle, "rb") as f:
        i = 0
        while block := f.read(piece_bytes):
            i += 1
            part = dst / f"part_{i:02d}"
            part.mkdir()
            (part / f"piece_{i:02d}").write_bytes(block)
            manifest["pieces"].append({"name": f"piece_{i:02d}", "sha256": hashlib.sha256(block).hexdigest(),
                                       "bytes": len(block)})
    bundle.unlink()
    for part in sorted(dst.glob("part_*")):
        (part / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def add(parts: Path, store: Path) -> tuple[list[str], list[str]]:
    """Copies every piece found under PARTS (a part folder, or a folder of them) into STORE, each checked against
    its manifest; returns (pieces STORE holds intact, pieces still missing)."""
    store.mkdir(parents=True, exist_ok=True)
    folders = [parts] if (parts / MANIFEST).is_file() else sorted(p for p in parts.glob("part_*") if p.is_dir())
    for folder in folders:
        manifest = json.loads((folder / MANIFEST).read_text())
        held = store / MANIFEST
        if held.is_file() and json.loads(held.read_text()) != manifest:
            raise SystemExit(f"add: {store} holds pieces of another preparation than {folder}: rm -rf {store} and "
                             "carry every part again")
        held.write_text(json.dumps(manifest, indent=1) + "\n")
        want = {p["name"]: p for p in manifest["pieces"]}
        for piece in sorted(folder.glob("piece_*")):
            if piece.name not in want:
                raise SystemExit(f"add: {piece} is not in its manifest")
            held_piece = store / piece.name
            if held_piece.is_file() and held_piece.stat().st_size == want[piece.name]["bytes"]:
                continue  # carried before (a carried folder may stay between warm calls); `join` checks it again
            if sha256(piece) != want[piece.name]["sha256"]:
                raise SystemExit(f"add: {piece}: sha256 differs from the manifest (damaged in transfer?)")
            shutil.copyfile(piece, held_piece)
    return status(store)


def status(store: Path) -> tuple[list[str], list[str]]:
    if not (store / MANIFEST).is_file():
        return [], ["(no manifest yet: carry any part)"]
    manifest = json.loads((store / MANIFEST).read_text())
    have, missing = [], []
    for p in manifest["pieces"]:
        f = store / p["name"]
        ok = f.is_file() and f.stat().st_size == p["bytes"]
        (have if ok else missing).append(p["name"])
    return have, missing


def join(store: Path, dest: Path) -> list[Path]:
    """All pieces in STORE -> the tar, checked, unpacked into DEST, each file checked; returns the files."""
    manifest = json.loads((store / MANIFEST).read_text())
    errors = []
    for p in manifest["pieces"]:
        f = store / p["name"]
        if not f.is_file():
            errors.append(f"{p['name']}: missing")
        elif sha256(f) != p["sha256"]:
            errors.append(f"{p['name']}: sha256 differs")
    if errors:
        raise SystemExit("join: " + "; ".join(errors))
    dest.mkdir(parents=True, exist_ok=True)
    bundle = dest / ".bundle.tar"
    h = hashlib.sha256()
    with open(bundle, "wb") as out:
        for p in manifest["pieces"]:
            with open(store / p["name"], "rb") as f:
                while block := f.read(MIB):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != manifest["bundle"]["sha256"]:
        bundle.unlink()
        raise SystemExit("join: the joined tar's sha256 differs from the manifest (pieces out of order or mixed?)")
    with tarfile.open(bundle) as tar:
        names = {m.name for m in tar.getmembers()}
        wanted = {f["name"] for f in manifest["files"]}
        if names != wanted or any("/" in n or n.startswith(".") for n in names):
            raise SystemExit(f"join: the tar holds {sorted(names ^ wanted)} beyond or short of the manifest")
        if sys.version_info >= (3, 12):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    bundle.unlink()
    out = []
    for f in manifest["files"]:
        p = dest / f["name"]
        if p.stat().st_size != f["bytes"] or sha256(p) != f["sha256"]:
            raise SystemExit(f"join: {p}: size or sha256 differs from the manifest")
        out.append(p)
    return out


def plan_calls(dirs: list[Path], limit_bytes: int = 61 * MIB) -> list[list[Path]]:
    """The part folders under DIRS grouped into device calls of at most LIMIT_BYTES each (a call carries 64 MiB with
    the working tree, about 2 MiB): first fit, in order, so a folder's parts arrive in their order."""
    calls: list[tuple[int, list[Path]]] = []
    for d in dirs:
        for part in sorted(p for p in d.glob("part_*") if p.is_dir()):
            size = sum(f.stat().st_size for f in part.iterdir())
            if size > limit_bytes:
                raise SystemExit(f"calls: {part} holds {size / MIB:.1f} MiB, over one call's {limit_bytes / MIB:.0f}")
            for i, (used, group) in enumerate(calls):
                if used + size <= limit_bytes:
                    calls[i] = (used + size, group + [part])
                    break
            else:
                calls.append((size, [part]))
    return [group for _, group in calls]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="SRC's files -> DIR/part_NN/{piece_NN, manifest.json}")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    s.add_argument("--piece-mib", type=int, default=60)
    a = sub.add_parser("add", help="copy the pieces under DIR into STORE, each checked")
    a.add_argument("parts", type=Path)
    a.add_argument("store", type=Path)
    j = sub.add_parser("join", help="join STORE's pieces, check, unpack into DEST, check each file")
    j.add_argument("store", type=Path)
    j.add_argument("dest", type=Path)
    c = sub.add_parser("calls", help="the part folders under DIRS grouped into device calls of at most 61 MiB")
    c.add_argument("dirs", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        m = split(args.src, args.dst, args.piece_mib * MIB)
        print(f"split: {len(m['files'])} files, {m['bundle']['bytes'] / MIB:.1f} MiB in {len(m['pieces'])} pieces "
              f"of at most {args.piece_mib} MiB: " + " ".join(f"{args.dst}/part_{i + 1:02d}" for i in range(len(m['pieces']))))
    elif args.cmd == "add":
        have, missing = add(args.parts, args.store)
        print(f"add: {args.store} holds {len(have)} of {len(have) + len(missing)} pieces" +
              (f"; missing {' '.join(missing)}" if missing else "; complete"))
    elif args.cmd == "calls":
        for i, group in enumerate(plan_calls(args.dirs), 1):
            mib = sum(f.stat().st_size for part in group for f in part.iterdir()) / MIB
            print(f"call {i}: carry {json.dumps([str(p) for p in group])}  ({mib:.1f} MiB)")
    else:
        files = join(args.store, args.dest)
        print(f"join: {len(files)} files in {args.dest}, each sha256 as in the manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
