"""Regenerate every committed ``bench/results/*_validation*.json`` with this tree (each file's own
exclusions, shares and hand-off: ``*_validation_handoff_pack.json`` asks the old runs what the new
hand-off would give) and say which differ from the committed bytes: a change to the planner that should
leave older results alone (a field they lack) is checked here. Exit 1 when any differs;
``--write`` rewrites the ones that do."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asympd.plan.validate import parse_exclusions, validate_e2e

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def regenerate(path: Path) -> str:
    """The validation of ``path``'s source result, as ``asympd plan --validate-out`` writes it."""
    old = json.loads(path.read_text())
    exclude = [f"{r['mode']}@{r['rate']:g}={r['excluded']}" for r in old["rows"] if r.get("excluded")]
    source = path.with_name(path.name.split("_validation")[0] + ".json")
    shares = old.get("shares", "equal")
    handoff = old.get("handoff_stream")  # recorded where the result has it, or asked (a what-if)
    v = validate_e2e(
        json.loads(source.read_text()), exclude=parse_exclusions(exclude), shares=shares, handoff_stream=handoff
    )
    return json.dumps(v, indent=1) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the validations that differ")
    args = ap.parse_args()
    differ = 0
    for path in sorted(RESULTS.glob("*_validation*.json")):
        new = regenerate(path)
        same = new == path.read_text()
        differ += not same
        print(f"{path.name}: {'byte-identical' if same else 'DIFFERS'}")
        if not same and args.write:
            path.write_text(new)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
