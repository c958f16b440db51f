"""The python tool keeps its word, escape by escape, on each sandbox level this machine offers.

Each case is code a model could write: a background child, a `setsid` child that outlives a timeout, a fork loop,
files that fill the disk, reading the trainer's environment and memory through /proc, signalling the trainer. The
"namespace" level runs where user namespaces work; "plain" is forced on the same machine (it is what hosts without
user namespaces get). When the tests run as root, the children run as `nobody`; `test_as_an_unprivileged_user` runs
the main cases as a non-root trainer too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from hybridrl.agent.tools.python import PythonTool
from hybridrl.agent.tools.sandbox import Platform, probe, protect_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox levels tested are Linux's")


def processes_with(marker: str) -> list[int]:
    """Pids of this machine's processes whose command line holds `marker` (every PID namespace shows in /proc)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def sleep_marker() -> str:
    """A `sleep` argument no other process uses: 300 s and a unique fraction."""
    return f"300.{uuid.uuid4().int % 10**9:09d}"


SYSTEM_PYTHON = "/usr/bin/python3"


def sandbox_python() -> str:
    """The interpreter the tests run code with: this one, or, when the tests run as root and only the system's
    interpreter can run as `nobody` (this one lives under /root, say), that one, so the children drop to nobody."""
    if os.geteuid() == 0 and probe(sys.executable).user is None and os.access(SYSTEM_PYTHON, os.X_OK):
        if probe(SYSTEM_PYTHON).user is not None:
            return SYSTEM_PYTHON
    return sys.executable


def levels() -> list[str]:
    found = probe(sandbox_python()).level
    return ["namespace", "plain"] if found == "namespace" else [found]


def make_tool(level: str, **kwargs) -> PythonTool:
    tool = PythonTool(python=sandbox_python(), **kwargs)
    found = probe(tool.python)
    if level != found.level:
        tool.sandbox._platform = Platform(level, found.user, f"{level} (forced by the test)")
    return tool


def as_root_without_nobody(tool: PythonTool) -> bool:
    """The code runs as root: it has every capability of root outside a namespace (documented as not promised)."""
    return os.geteuid() == 0 and tool.sandbox.platform.user is None


def run(tool: PythonTool, code: str, timeout: float = 20.0) -> tuple[bool, str]:
    """(failed, what the model reads) for one call with the loop's wall-clock timeout."""

    async def call() -> str:
        return await asyncio.wait_for(tool.acall({"code": code}), timeout)

    try:
        return False, asyncio.run(call())
    except asyncio.TimeoutError:
        return True, "timed out"
    except Exception as e:  # ToolError: what the model reads
        return True, str(e)


def gone(marker: str, within_s: float = 3.0) -> bool:
    end = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < end:
        time.sleep(0.05)
    return processes_with(marker) == []


@pytest.fixture(params=levels())
def level(request) -> str:
    return request.param


def test_a_background_child_dies_when_the_call_ends_normally(level):
    marker = sleep_marker()
    failed, out = run(make_tool(level), f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint('left')")
    assert not failed and out.strip() == "left", out
    assert gone(marker)


def test_a_setsid_child_dies_when_the_call_times_out(level):
    marker = sleep_marker()
    code = (
        f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "print('started', flush=True)\ntime.sleep(60)"
    )
    t0 = time.monotonic()
    failed, out = run(make_tool(level), code, timeout=2.0)
    assert failed and out == "timed out"
    assert time.monotonic() - t0 < 10
    assert gone(marker)


def test_a_double_forked_daemon_dies_too(level):
    marker = sleep_marker()
    code = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{marker}'])\n    os._exit(0)\nos.wait()\nprint('daemonized')"
    )
    failed, out = run(make_tool(level), code)
    assert not failed and "daemonized" in out, out
    assert gone(marker)


def test_a_fork_loop_is_stopped_at_max_processes(level):
    tool = make_tool(level, max_processes=16)
    if as_root_without_nobody(tool):
        pytest.skip("the kernel does not enforce RLIMIT_NPROC for root, and the children cannot run as nobody here")
    marker = sleep_marker()
    code = (
        "import os\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
        f"            os.execvp('sleep', ['sleep', '{marker}'])\n        n += 1\n"
        "except OSError as e:\n    print('stopped after', n, type(e).__name__)"
    )
    failed, out = run(tool, code)
    assert not failed and out.startswith("stopped after"), out
    assert int(out.split()[2]) < 16
    assert gone(marker)


def test_disk_writes_stop_at_the_quota(level):
    code = (
        "import os\nn = 0\ntry:\n    while n < 40:\n        with open(f'f{n}', 'wb') as f:\n"
        "            f.write(os.urandom(1 << 20) * 15)\n        n += 1\nexcept OSError as e:\n"
        "    print('stopped after', n, 'files:', e.strerror)\n"
        "import time\ntime.sleep(2)\nprint('still here')"
    )
    failed, out = run(make_tool(level, disk_mb=32, file_mb=16), code)
    if level == "namespace":  # the tmpfs is full: the program's own write fails
        assert not failed and "No space left on device" in out, out
        assert int(out.split()[2]) <= 2  # 15 MiB files in 32 MiB
    else:  # the supervisor sees the folder pass the quota and stops the program
        assert failed and "wrote more than 32 MiB (its disk quota) and was stopped" in out, out


def test_outside_the_scratch_folder_nothing_is_writable_with_namespaces():
    if probe(sandbox_python()).level != "namespace":
        pytest.skip("only the namespace level makes the rest of the file system read-only")
    folder = Path(tempfile.mkdtemp(prefix="hybridrl-test-"))
    try:
        os.chmod(folder, 0o777)  # writable by anyone: only the mount can refuse it
        target = folder / "escape.txt"
        failed, out = run(make_tool("namespace"), f"open({str(target)!r}, 'w').write('x')")
        assert failed and "Read-only file system" in out, out
        assert not target.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_trainers_environment_and_memory_stay_closed(level, monkeypatch):
    planted = f"planted-{uuid.uuid4().hex}"
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", planted)  # in this process's memory and environ from now on
    protect_process()  # what the tool's constructor does in each trainer process
    trainer = os.getpid()
    code = f"""
import os
found = []
for path in ['/proc/{trainer}/environ', '/proc/%d/environ' % os.getppid(), '/proc/{trainer}/mem']:
    try:
        with open(path, 'rb') as f:
            data = f.read(1 << 20) if 'mem' not in path else b''
            if 'mem' in path:
                for line in open('/proc/{trainer}/maps'):
                    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                    try:
                        f.seek(lo)
                        data += f.read(min(hi - lo, 1 << 22))
                    except OSError:
                        pass
        found.append((path, {planted!r}.encode() in data))
    except OSError as e:
        found.append((path, type(e).__name__))
for pid in os.listdir('/proc'):
    if pid.isdigit():
        try:
            if {planted!r}.encode() in open('/proc/%s/environ' % pid, 'rb').read():
                found.append(('environ of ' + pid, True))
        except OSError:
            pass
print(found)
"""
    tool = make_tool(level)
    if level == "plain" and as_root_without_nobody(tool):
        pytest.skip("code running as root outside a namespace can read any process (documented as not promised)")
    failed, out = run(tool, code)
    assert not failed, out
    assert "True" not in out, out  # no path gave the planted value


def test_the_code_cannot_signal_the_trainer(level):
    code = f"import os, signal\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reachable')\nexcept OSError as e:\n"
    code += "    print(type(e).__name__)"
    tool = make_tool(level)
    failed, out = run(tool, code)
    assert not failed, out
    if level == "namespace" or (os.geteuid() == 0 and not as_root_without_nobody(tool)):
        assert out.strip() in ("ProcessLookupError", "PermissionError"), out
    else:  # plain, same user: documented as reachable
        assert out.strip() in ("reachable", "ProcessLookupError", "PermissionError"), out


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become another user")
@pytest.mark.parametrize("level", levels())
def test_as_an_unprivileged_trainer(level):
    """A trainer that is not root (what users run): RLIMIT_NPROC enforced, every descendant killed, its environment
    closed. The sandbox module is loaded on its own by the system interpreter running as `nobody`."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON}")
    folder = Path(tempfile.mkdtemp(prefix="hybridrl-test-"))
    os.chmod(folder, 0o755)
    marker = sleep_marker()
    module = Path(__file__).parents[3] / "hybridrl" / "agent" / "tools" / "sandbox.py"
    fork = (
        "import os\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n"
        f"            os.execvp('sleep', ['sleep', '{marker}'])\n        n += 1\nexcept OSError:\n"
        "    print('stopped after', n)"
    )
    script = f"""
import asyncio, importlib.util, json, os, resource, sys
os.environ['HYBRIDRL_TEST_SECRET'] = 'planted-{marker}'
spec = importlib.util.spec_from_file_location('sandbox', {str(module)!r})
sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
print(sandbox.protect_process(), file=sys.stderr)
box = sandbox.Sandbox(sys.executable, [(resource.RLIMIT_CORE, 0, 0)], 32 << 20, 8)
found = sandbox.probe(sys.executable)
box._platform = sandbox.Platform({level!r}, None, 'test')
async def call(code):
    r = await asyncio.wait_for(box.run(code.encode(), {{'PATH': '/usr/bin:/bin'}}, 65536), 30)
    return r.output.decode(errors='replace')
peek = "print(open('/proc/{{}}/environ', 'rb').read())".format(os.getpid())
print(json.dumps({{'uid': os.getuid(), 'found': found.level, 'fork': asyncio.run(call({fork!r})),
                  'peek': asyncio.run(call(peek))}}))
"""
    (folder / "check.py").write_text(script)
    os.chmod(folder / "check.py", 0o644)
    try:
        r = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, str(folder / "check.py")],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"},
            cwd="/",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["uid"] == 65534 and (level == "plain" or got["found"] == "namespace"), got
    assert got["fork"].startswith("stopped after") and int(got["fork"].split()[2]) < 8, got
    assert f"planted-{marker}" not in got["peek"] and "Error" in got["peek"], got
    assert gone(marker)


def test_the_basic_level_kills_what_is_left_of_the_process_group():
    """What macOS gets: no namespaces and no /proc, but the program's process group dies with it."""
    marker = sleep_marker()
    code = (
        "import subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print('left')"
    )
    failed, out = run(make_tool("basic"), code)
    assert not failed and out.strip() == "left", out
    assert gone(marker)
