"""Run every benchmark, one after another, with one command.

    python benchmarks/run_all.py            # full sizes (tens of minutes on a laptop CPU)
    python benchmarks/run_all.py --quick    # reduced sizes (a few minutes)

Each script prints its own table (markdown) with the date, machine and sizes; this runner only
sequences them, so a failing one does not hide the others' results.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# script -> extra arguments at full size (memory_techniques needs an explicit size flag)
SCRIPTS = {
    "roofline.py": [],
    "vs_captum.py": [],
    "vs_dattri.py": [],
    "store_stream.py": [],
    "curvature_fit.py": [],
    "memory_techniques.py": ["--full"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes")
    parser.add_argument("--only", nargs="+", choices=sorted(SCRIPTS), help="a subset")
    args = parser.parse_args()
    failed = []
    for script in args.only or SCRIPTS:
        extra = ["--quick"] if args.quick else SCRIPTS[script]
        print(f"\n## {script} {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
        done = subprocess.run([sys.executable, os.path.join(HERE, script), *extra], env=env)
        print(f"({script}: {time.perf_counter() - start:.0f} s, exit {done.returncode})",
              flush=True)
        if done.returncode:
            failed.append(script)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
