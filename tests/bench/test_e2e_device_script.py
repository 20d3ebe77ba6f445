"""bench/e2e_device.sh refuses to start a device study whose result would carry a wrong commit."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "e2e_device.sh"


def run(commit: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "ASYMPD_COMMIT": commit}
    return subprocess.run(["bash", str(SCRIPT), "x", "asymmetric"], env=env, capture_output=True, text=True)


def test_a_short_or_mistyped_commit_is_refused_before_any_work(tmp_path):
    for commit in ("", "7af8579", "7af85797", "g" * 40):
        r = run(commit, tmp_path)
        assert r.returncode == 2
        assert r.stderr == f"set ASYMPD_COMMIT to the full hash of the checkout (git rev-parse HEAD), not '{commit}'\n"
    assert list(tmp_path.iterdir()) == []  # nothing installed, run or written
