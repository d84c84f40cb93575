"""Snapshots of every profile's composition: tests/data/profiles/<profile>.yaml is the params.yaml that
`dvc exp run -S profile=<profile>` composes from conf/, and a test compares each profile with its snapshot, so an
edit of conf/ that reaches a profile it was not meant for fails there, and a deliberate one shows in review as the
snapshots' diff. After a deliberate change: `python tools/profiles.py` rewrites them (`--check`: only compare)."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml
from dvc.utils.hydra import compose_and_dump

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SNAPSHOTS = ROOT / "tests" / "data" / "profiles"


def profiles(conf: Path = CONF) -> list[str]:
    return sorted(path.stem for path in (conf / "profile").glob("*.yaml"))


def composed(profile: str, conf: Path = CONF) -> str:
    """The text of params.yaml as DVC's Hydra composition writes it for `profile`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "params.yaml"
        compose_and_dump(out, str(conf), None, "config", "", [f"profile={profile}"])
        return out.read_text()


def differences(snapshot: dict, now: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two compositions (added, removed or changed)."""
    keys = list(snapshot) + [key for key in now if key not in snapshot]
    found = []
    for key in keys:
        name, before, after = f"{prefix}{key}", snapshot.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(before, dict) and isinstance(after, dict):
            found += differences(before, after, name + ".")
        elif before != after:
            found.append(f"{name}: {before!r} -> {after!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--check", action="store_true", help="compare only; exit 1 when a profile differs")
    args = cli.parse_args(argv)
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    changed = 0
    for profile in profiles():
        path, text = SNAPSHOTS / f"{profile}.yaml", composed(profile)
        before = yaml.safe_load(path.read_text()) if path.is_file() else {}
        moved = differences(before, yaml.safe_load(text))
        changed += bool(moved)
        for line in moved:
            print(f"{profile}: {line}")
        if moved and not args.check:
            path.write_text(text)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
