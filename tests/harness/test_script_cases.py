"""tests.script_cases runs a script once per argv in one process: each case's exit status and
output must be its own, as if it had run alone (tests.helpers.run_script_cases)."""

import pytest

from tests.helpers import run_script, run_script_cases

SCRIPT = '''
import logging, sys
if not logging.getLogger("x").handlers:   # made by the first case, kept by the process
    logging.getLogger("x").addHandler(logging.StreamHandler(sys.stderr))
what = sys.argv[1]
print("out", what)
if what == "log":
    logging.getLogger("x").warning("logged %s", what)
elif what == "exit2":
    sys.exit(2)
elif what == "message":
    sys.exit("error: a message")
elif what == "raise":
    raise ValueError("boom")
'''


@pytest.mark.timeout(60)
def test_each_case_gets_its_own_output_and_exit_status_as_alone(tmp_path):
    path = tmp_path / "cases.py"
    path.write_text(SCRIPT)
    names = ["ok", "log", "exit2", "message", "raise", "log"]
    batched = run_script_cases(path, [[n] for n in names], timeout=50)
    for name, got in zip(names, batched):
        alone = run_script(path, name, timeout=50)
        assert got.returncode == alone.returncode, (name, got, alone)
        assert got.stdout == alone.stdout, (name, got.stdout, alone.stdout)
        assert got.stderr.splitlines()[-1:] == alone.stderr.splitlines()[-1:], (
            name, got.stderr, alone.stderr)
        assert ("Traceback" in got.stderr) == ("Traceback" in alone.stderr), name
