"""The suite's own isolation: a script a test starts inherits no launch variables."""

from __future__ import annotations

import pytest

from tests.helpers import run_script


@pytest.mark.timeout(60)
def test_a_script_started_by_a_test_inherits_no_launch_variables(tmp_path, monkeypatch):
    # What an in-process dpt.dist.setup or a launcher leaves in os.environ.
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999")):
        monkeypatch.setenv(name, value)
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n"
                     "names = ('LOCAL_RANK', 'RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')\n"
                     "print(sorted(n for n in names if n in os.environ))\n")
    proc = run_script(probe, env={"KEPT": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", (
        "launch variables reached a script started by a test: a Lightning ddp script would "
        f"believe a launcher started it and wait forever for rank 1: {proc.stdout}")
