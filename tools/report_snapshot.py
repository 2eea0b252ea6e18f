"""Write every shipped config's diagnose report, timing fields removed, to one folder.

Run it before and after a refactor and diff the folders: a move that changes no
behaviour leaves them identical.

    python tools/report_snapshot.py OUT_DIR [--compare OTHER_DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Fields that measure the machine, not the run: seconds, budgets, versions of the clock.
TIMING_KEYS = {
    "seconds",
    "elapsed_s",
    "duration_s",
    "started_at",
    "finished_at",
    "wall_s",
    "timestamp",
    "created",
    "time_s",
    "replay_seconds",
    "verify_seconds",
}


def strip_timing(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: strip_timing(v)
            for k, v in value.items()
            if k not in TIMING_KEYS and not k.endswith("_seconds") and not k.endswith("_s")
        }
    if isinstance(value, list):
        return [strip_timing(v) for v in value]
    return value


def snapshot(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        target = out / f"{config.stem}.json"
        cmd = [sys.executable, "-m", "nandoctor", "diagnose", str(config), "--json", "-", "-q"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        try:
            report = json.loads(done.stdout)
        except json.JSONDecodeError:
            report = {"unparseable": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
        report = {"exit_code": done.returncode, "report": strip_timing(report)}
        target.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        print(f"{config.name}: exit {done.returncode}", flush=True)


def compare(a: Path, b: Path) -> int:
    differ = 0
    for left in sorted(a.glob("*.json")):
        right = b / left.name
        if not right.exists() or left.read_text() != right.read_text():
            print(f"DIFFERS: {left.name}")
            differ += 1
    print(f"{differ} report(s) differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    snapshot(args.out)
    return compare(args.compare, args.out) if args.compare else 0


if __name__ == "__main__":
    raise SystemExit(main())
