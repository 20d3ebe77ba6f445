"""Every committed one-GPU validation (P and D sharing the GPU, ``bench/results/*_validation.json``
made at equal shares) recomputed under other ways to split the shared GPU (``asympd plan
--validate-shares``), and how many of its rows each puts within the 15 % target on all three
metrics: a what-if over the whole record rather than the run a rule was read from. Runs merged into
a ``_two`` / ``_five`` file are counted there and in their parts.

    python tools/shares_what_if.py --shares equal,host-split --json bench/results/planner_shares_what_if.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.plan.validate import SHARES, parse_exclusions, validate_e2e  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def what_if(path: Path, shares: list[str]) -> dict[str, Any] | None:
    """One validation file's rows within the target under each of ``shares`` (its own exclusions and
    hand-off), or None where it is not an equal-shares validation of a shared GPU."""
    old = json.loads(path.read_text())
    if old.get("shares", "equal") != "equal" or old.get("placement") != "shared" or "tiny" in path.name:
        return None
    source = json.loads(path.with_name(path.name.split("_validation")[0] + ".json").read_text())
    exclude = parse_exclusions([f"{r['mode']}@{r['rate']:g}={r['excluded']}" for r in old["rows"] if r.get("excluded")])
    out: dict[str, Any] = {"file": path.name}
    for share in shares:
        v = validate_e2e(source, exclude=exclude, shares=share, handoff_stream=old.get("handoff_stream"))
        rows = [r for r in v["rows"] if not r.get("excluded") and "within_target" in r]
        out[share] = {"within": sum(r["within_target"] for r in rows), "rows": len(rows)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="equal,host-split", help=f"comma-separated, of {', '.join(SHARES)}")
    ap.add_argument("--json", default=None, help="write the table here too")
    args = ap.parse_args()
    shares = [s.strip() for s in args.shares.split(",") if s.strip()]
    bad = [s for s in shares if s not in SHARES]
    if bad:
        ap.error(f"unknown shares {', '.join(bad)}: choose from {', '.join(SHARES)}")
    files = [r for p in sorted(RESULTS.glob("*_validation.json")) if (r := what_if(p, shares))]
    for r in files:
        print(r["file"], *(f"{s} {r[s]['within']}/{r[s]['rows']}" for s in shares))
    total = {s: {k: sum(r[s][k] for r in files) for k in ("within", "rows")} for s in shares}
    print("all files:", *(f"{s} {t['within']}/{t['rows']}" for s, t in total.items()))
    if args.json:
        git = ["git", "-C", str(RESULTS), "rev-parse", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or None
        record = {"command": " ".join(["python", *sys.argv]), "commit": commit, "shares": shares}
        Path(args.json).write_text(json.dumps(record | {"files": files, "total": total}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
