"""Built-in runs beside the default, as packaged YAML configs: `tailrl train --preset NAME` reads `NAME.yaml` from
here first, then the user's YAML, then the dotted overrides (so a preset validates like any config, and anything in
it can be overridden). The default `tailrl train` reads none of them."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def preset_file(name: str) -> Path | None:
    """The preset's YAML, or None when there is no such preset."""
    path = DIR / f"{name}.yaml"
    return path if name and path.is_file() else None
