"""`asympd plan` imports no torch: importing it took 2.3-2.8 s of a planner run of seconds. A plan and a
validation in a fresh interpreter; a module on their path that imports torch again fails here."""

import subprocess
import sys

from tools.regen_validations import RESULTS

RUN = """
import sys
from asympd.cli import main
plan = "plan --gpu H200 --rate 1 --requests 20 --mode asymmetric --jobs 1 --slo-ttft-p99 8 --slo-itl-p99 150"
assert main(plan.split()) == 0
assert main(["plan", "--validate", sys.argv[1]]) in (0, 1)
print("torch loaded:", sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


def test_plan_and_validate_import_no_torch():
    cmd = [sys.executable, "-c", RUN, str(RESULTS / "e2e_tiny.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=RESULTS.parents[1]).stdout
    # which import pulled it in: python -X importtime -m asympd.cli plan ... 2>&1 | grep -B30 ' torch$'
    assert out.splitlines()[-1] == "torch loaded: []"
