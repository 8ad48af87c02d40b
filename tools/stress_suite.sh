#!/usr/bin/env bash
# Run the whole test suite N times on a fresh clone while a CPU hog keeps every core busy.
#
#   tools/stress_suite.sh 10                 # 10 runs of `make test`
#   tools/stress_suite.sh 3 -m "not slow"    # extra arguments go to pytest
#
# The clone gets its own venv (`make setup data`, as a new user would), under
# $STRESS_DIR (default: a new folder in /tmp). Each run writes a JUnit XML; at the end the script
# prints how many runs passed, the wall time of each, the failing tests and the slowest tests.
# Exit status: 0 when every run passed, 1 otherwise.
set -euo pipefail

runs=${1:-10}
shift || true
case "$runs" in '' | *[!0-9]*) echo "error: N must be a whole number, got '$runs'" >&2; exit 2 ;; esac
[ "$runs" -ge 1 ] || { echo "error: N must be at least 1" >&2; exit 2; }

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${STRESS_DIR:-$(mktemp -d /tmp/dpt-stress-XXXXXX)}
mkdir -p "$work"
clone=$work/clone
hogs=()

stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
    hogs=()
}
trap stop_hogs EXIT INT TERM

if [ ! -d "$clone/.git" ]; then
    echo "[stress] cloning $repo into $clone"
    git clone -q "$repo" "$clone"
fi
cd "$clone"
echo "[stress] setting up the clone's own venv and data (make setup data)"
make -s setup data >"$work/setup.log" 2>&1 || { tail -20 "$work/setup.log"; exit 1; }

cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
for _ in $(seq "$cores"); do
    (while :; do :; done) &
    hogs+=($!)
done
echo "[stress] $cores CPU hog(s) running (pids ${hogs[*]}); $runs run(s) of the suite"

passed=0
: >"$work/times.txt"
for i in $(seq "$runs"); do
    start=$(date +%s)
    set +e
    make -s test PYTEST_ARGS="-p no:cacheprovider --junitxml=$work/run$i.xml $*" \
        >"$work/run$i.log" 2>&1
    rc=$?
    set -e
    secs=$(( $(date +%s) - start ))
    echo "$i $rc $secs" >>"$work/times.txt"
    last=$(grep -E '(passed|failed|error)' "$work/run$i.log" | tail -n 1 || true)
    echo "[stress] run $i/$runs: exit $rc in ${secs}s: $last"
    [ "$rc" -eq 0 ] && passed=$((passed + 1))
done
stop_hogs

.venv/bin/python - "$work" "$runs" "$passed" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

work, runs, passed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
times = [line.split() for line in (work / "times.txt").read_text().splitlines()]
durations, failures = defaultdict(list), defaultdict(list)
for i in range(1, runs + 1):
    path = work / f"run{i}.xml"
    if not path.exists():
        continue
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        durations[name].append(float(case.get("time") or 0))
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            failures[name].append((i, (bad.get("message") or "").splitlines()[0][:200]))
secs = sorted(int(t[2]) for t in times)
print(f"\n[stress] {passed} of {runs} runs passed under a CPU hog on every core")
print(f"[stress] wall time per run: min {secs[0]} s, median {secs[len(secs) // 2]} s, "
      f"max {secs[-1]} s")
if failures:
    print("[stress] failing tests (run: first line of the message):")
    for name, items in sorted(failures.items()):
        for run, msg in items:
            print(f"  {name}  [run {run}] {msg}")
print("[stress] slowest tests (max over runs, seconds):")
for name, ds in sorted(durations.items(), key=lambda kv: -max(kv[1]))[:15]:
    print(f"  {max(ds):7.1f}  {name}")
print(f"[stress] logs and JUnit files: {work}")
EOF
[ "$passed" -eq "$runs" ]
