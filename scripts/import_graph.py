"""The import graph of tailrl/ between rooms (folders), read from the AST: relative and absolute imports, lazy
imports inside functions included. Prints the arrows between rooms, the cycles (file level and room level), the
arrows that run up against the intended order, and each room's share of the lines. Exit code 1 on a cycle or an
arrow up.

    python scripts/import_graph.py [path/to/tailrl]

A room is a folder (rl/actor, rollout/vllm, ...); the cli*.py files are the room `cli`; the other top-level files
(metrics, loggers, console, report, user_code) and presets/ are the room `tailrl`, the bottom floor. The intended
order, top to bottom (docs/design.md): cli -> rl -> rollout -> {agent, cluster, config, drafter} -> engine ->
speculative -> model -> tailrl. A room's floor is its top package's (rl/actor is on rl's floor). An arrow from a
room to a room on a higher floor is an arrow up; arrows within a floor are allowed (a cycle among them is not).
A subfolder may import its parent folder's own files (rl/actor uses rl/algos.py): such an arrow is not counted in
the room cycles, only in the file cycles.
Upward calls by string (importlib) are not imports, so they do not show here: DESIGN forbids them outright."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

FLOORS = (("cli",), ("rl",), ("rollout",), ("agent", "cluster", "config", "drafter"), ("engine",), ("speculative",),
          ("model",), ("tailrl", "presets"))
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str, is_package: bool) -> str:
    """`tailrl.rl.actor.actor` -> rl/actor; `tailrl.cli_eval` -> cli; `tailrl.metrics` -> tailrl."""
    parts = module.split(".")[1:]
    folder = parts if is_package else parts[:-1]
    if not folder:
        return "cli" if parts and parts[0].startswith("cli") else "tailrl"
    return "/".join(folder)


def floor_of(room: str) -> int:
    return FLOOR.get(room.split("/")[0], len(FLOORS))


def imports_of(tree: ast.AST, module: str, is_package: bool, modules: set[str]):
    """(line, imported module) for every import of one of `modules`, wherever it sits in the file."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name not in modules and "." in name:  # `import tailrl.rl.x.y` names the module tailrl.rl.x.y
                name = name.rpartition(".")[0]
            if name in modules and name != module:
                yield node.lineno, name


def read_tree(root: Path) -> dict:
    """{module: (room, lines, [(line, imported module)])} for every .py file under root."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    out = {}
    for module, path in files.items():
        text = path.read_text()
        is_package = path.name == "__init__.py"
        edges = list(imports_of(ast.parse(text), module, is_package, set(files)))
        out[module] = (room_of(module, is_package), len(text.splitlines()), edges)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def check(root: Path | str) -> dict:
    """The graph's findings: file_cycles, room_cycles, arrows_up (room, room, [module:line -> module]), rooms
    ({room: lines}), arrows ({(room, room): count})."""
    tree = read_tree(Path(root))
    files = defaultdict(set)
    rooms = defaultdict(set)
    arrows = defaultdict(int)
    why = defaultdict(list)
    lines = defaultdict(int)
    for module, (room, n, edges) in tree.items():
        lines[room] += n
        for line, target in edges:
            files[module].add(target)
            to = tree[target][0]
            if to != room:
                if not room.startswith(to + "/"):  # a subfolder using its parent's files: see the docstring
                    rooms[room].add(to)
                arrows[room, to] += 1
                if (where := f"{module}:{line} -> {target}") not in why[room, to]:
                    why[room, to].append(where)
    up = [(a, b, why[a, b]) for a, b in sorted(arrows) if floor_of(b) < floor_of(a)]
    return {"file_cycles": cycles(files), "room_cycles": cycles(rooms), "arrows_up": up, "rooms": dict(lines),
            "arrows": dict(arrows)}


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "tailrl"
    r = check(root)
    total = sum(r["rooms"].values())
    print(f"rooms ({total} lines), by floor:")
    for room in sorted(r["rooms"], key=lambda x: (floor_of(x), x)):
        out = sorted(b for a, b in r["arrows"] if a == room)
        print(f"  {floor_of(room)} {room:<16} {r['rooms'][room]:>6} lines {100 * r['rooms'][room] / total:5.1f}%"
              f"  -> {', '.join(out) or '-'}")
    packages = defaultdict(int)
    for room, n in r["rooms"].items():
        packages[room.split("/")[0]] += n
    print("packages: " + ", ".join(f"{p} {100 * n / total:.1f}%" for p, n in sorted(packages.items(), key=lambda x: -x[1])))
    print(f"{len(r['arrows'])} arrows between rooms")
    for kind in ("file_cycles", "room_cycles"):
        print(f"{kind.replace('_', ' ')}: {len(r[kind])}")
        for c in r[kind]:
            print("  " + " <-> ".join(c))
    print(f"arrows up: {len(r['arrows_up'])}")
    for a, b, where in r["arrows_up"]:
        print(f"  {a} -> {b}: " + "; ".join(where))
    return 1 if r["file_cycles"] or r["room_cycles"] or r["arrows_up"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
