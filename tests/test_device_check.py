"""benchmarks/device_check.sh: each stage runs the benchmarks it names, with options those scripts take (a fake
``python`` records the calls: the real ones need a GPU)."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
FAKE_PYTHON = """#!/bin/sh
echo "$@" >> "$CALLS"
"""


def stage_calls(stage: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/bin/sh\necho GPU\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "CALLS": str(calls)}
    done = subprocess.run(["bash", str(SCRIPT), stage], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return done, [shlex.split(line) for line in lines if line.startswith("benchmarks/")]


@pytest.mark.parametrize("stage,scripts", [
    ("first", ["probe_kernels", "gpu_check"]),
    ("second", ["profile_model", "profile_model", "profile_mix", "host_overhead", "gpu_check"]),
    ("all", ["probe_kernels", "gpu_check", "profile_model", "profile_model", "profile_mix", "host_overhead",
             "gpu_check"]),
])
def test_each_stage_runs_its_benchmarks_with_options_they_take(stage, scripts, tmp_path):
    done, calls = stage_calls(stage, tmp_path)
    assert done.returncode == 0, done.stderr
    assert [Path(call[0]).stem for call in calls] == scripts
    for call in calls:
        source = (ROOT / call[0]).read_text()
        for option in (a for a in call[1:] if a.startswith("--")):
            assert re.search(rf"add_argument\(\s*\"{option}\"", source), f"{call[0]} takes no {option}"
    log = (tmp_path / "out" / "machine.txt").read_text()
    assert f"stage {stage}" in log and all("exit 0 in" in line for line in log.splitlines() if ": exit" in line)


def test_the_first_stage_checks_parity_first():
    """gpu_check's first section is parity: a kernel that computes something else fails the run before its
    speed rows (the probe before it times the kernels only; it judges nothing)."""
    text = SCRIPT.read_text()
    first = re.search(r"gpu_check\.py --sections (\S+)", text)
    assert first is not None and first.group(1).split(",")[0] == "parity"


def test_an_unknown_stage_is_one_line_error(tmp_path):
    done, calls = stage_calls("nope", tmp_path)
    assert done.returncode == 2 and calls == []
    assert "nope" in done.stderr and len(done.stderr.strip().splitlines()) == 1
