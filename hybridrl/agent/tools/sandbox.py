"""Where the `python` tool's children run: what this platform allows, probed once per process, and one call.

    sandbox = Sandbox(python, rlimits, disk_bytes, max_processes)
    result = await sandbox.run(code, max_output_bytes)   # output, exit code, why it stopped
    sandbox.kill(...)                                     # on a timeout or cancel: the whole call, every descendant

Three levels, best first (`Sandbox.level`; the first call logs which one and why):

- "namespace" (Linux with user namespaces, as most distributions allow without root): the supervisor
  (`sandbox_init.py`) is pid 1 of a fresh PID namespace, so every process the program starts dies when it ends,
  `setsid` or not; the file system is read-only but for one tmpfs of `disk_bytes` (cwd, TMPDIR, /dev/shm); the
  program sees only its own namespace's processes in /proc and can signal no process outside; RLIMIT_NPROC counts
  only its own processes.
- "plain" (Linux without user namespaces: some containers, AppArmor-restricted hosts): the supervisor is a child
  subreaper that kills every descendant at the end; RLIMIT_NPROC is the user's current processes plus
  `max_processes`; the working folder's size is checked every 0.05 s; other folders the user can write stay writable.
- "basic" (other systems): the program runs directly in its own session, killed as a process group at the end
  (a child that starts a session of its own escapes that).

On every level: rlimits (CPU seconds, address space, file size, open files, no core dumps), an environment with
nothing inherited, `python -I`, and, when the trainer runs as root, the children run as `nobody` (if that user can
run the interpreter): another user cannot read the trainer's environment or memory, signal it, or read its 0600
files. `protect_process()` makes the trainer's own processes non-dumpable, which closes /proc/<pid>/environ and
/proc/<pid>/mem to children of the same user (and to debuggers such as py-spy without sudo).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SUPERVISOR = Path(__file__).with_name("sandbox_init.py")
_UNSHARE_ARGS = ("--user", "--map-root-user", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc")
PR_SET_DUMPABLE = 4


@functools.lru_cache(maxsize=1)
def _supervisor_source() -> str:
    """sandbox_init.py's text, run with `python -I -c`: no file of this package needs to be readable by the user the
    children run as."""
    return _SUPERVISOR.read_text()


def protect_process() -> bool:
    """Make this process non-dumpable (Linux): /proc/<pid>/environ, mem and ptrace closed to other processes of the
    same user that lack CAP_SYS_PTRACE, such as the code the python tool runs. Reset by exec, so every trainer
    process calls it. Returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class Platform:
    """What the tool can use for its children here."""

    level: str
    """namespace | plain | basic (see the module docstring)."""
    user: tuple[int, int] | None
    """(uid, gid) the children run as when the trainer is root, else None (the trainer's own user)."""
    why: str
    """One line for the log: the level, and why not a better one."""


def _spec(mode: str, scratch: str, python: str, env: dict[str, str], disk: int, procs: int, fd: int) -> str:
    return json.dumps(
        {
            "mode": mode,
            "scratch": scratch,
            "python": python,
            "env": env,
            "disk_bytes": disk,
            "max_processes": procs,
            "status_fd": fd,
        }
    )


def _try(argv_head: list[str], mode: str, python: str, user: tuple[int, int] | None) -> str | None:
    """Run `pass` through the supervisor in `mode`; None when it worked, else why not."""
    scratch = tempfile.mkdtemp(prefix="hybridrl-python-probe-")
    r, w = os.pipe()
    try:
        if user is not None:
            os.chown(scratch, *user)
        spec = _spec(mode, scratch, python, {"PATH": "/usr/bin:/bin"}, 1 << 20, 16, w)
        cmd = [*argv_head, python, "-I", "-c", _supervisor_source(), spec]
        kwargs: dict[str, Any] = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
        done = subprocess.run(
            cmd, input=b"pass\n", capture_output=True, timeout=60, pass_fds=(w,), cwd=scratch, **kwargs
        )
        os.close(w)
        w = -1
        status = json.loads(os.read(r, 65536) or b"{}")
        if done.returncode == 0 and status.get("exit") == 0:
            return None
        detail = status.get("why") or done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        return detail.splitlines()[-1][:200]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        shutil.rmtree(scratch, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def probe(python: str) -> Platform:
    """The best level that works here for `python` (cached per process)."""
    if not sys.platform.startswith("linux"):
        return Platform("basic", None, f"basic: {sys.platform} has no PID namespaces or subreapers")
    user = None
    dropped = ""
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam("nobody")
            candidate = (entry.pw_uid, entry.pw_gid)
        except KeyError:
            candidate = None
        why_not = _try([], "plain", python, candidate) if candidate else "there is no user 'nobody'"
        if why_not is None:
            user, dropped = candidate, "; as user nobody (the trainer runs as root)"
        else:
            dropped = f"; as root, since running {python} as nobody failed ({why_not})"
    unshare = shutil.which("unshare")
    if unshare is None:
        return Platform("plain", user, f"plain: no `unshare` program (util-linux){dropped}")
    why_not = _try([unshare, *_UNSHARE_ARGS], "namespace", python, user)
    if why_not is None:
        return Platform("namespace", user, f"namespace: own PID, user and mount namespaces{dropped}")
    return Platform("plain", user, f"plain: user namespaces unavailable ({why_not}){dropped}")


@dataclass
class CallResult:
    """One call's output and how it ended."""

    output: bytes
    flooded: bool
    exit: int | None
    """The program's exit code (negative: the signal), None when the supervisor did not say."""
    why: str | None
    """None, "disk" (past the quota in plain mode) or the supervisor's own failure."""


class Sandbox:
    """Runs programs at this platform's best level (see the module docstring)."""

    def __init__(self, python: str, rlimits: list[tuple[int, int, int]], disk_bytes: int, max_processes: int) -> None:
        self.python, self.rlimits = python, rlimits
        self.disk_bytes, self.max_processes = disk_bytes, max_processes
        self._platform: Platform | None = None

    @property
    def platform(self) -> Platform:
        """The level in use (probed on first use; logged once per process)."""
        if self._platform is None:
            known = probe.cache_info().currsize
            self._platform = probe(self.python)
            if probe.cache_info().currsize > known:
                log.info("python tool: %s", self._platform.why)
        return self._platform

    async def run(self, code: bytes, env: dict[str, str], max_output: int) -> CallResult:
        """Run `code` and read at most `max_output` + 1 bytes of its output; every process it started is gone when
        this returns or raises (a cancel, the loop's timeout)."""
        plat = self.platform
        scratch = tempfile.mkdtemp(prefix="hybridrl-python-")
        r, w = os.pipe()
        proc = None
        try:
            if plat.user is not None:
                os.chown(scratch, *plat.user)
            if plat.level == "basic":
                argv, cwd = [self.python, "-I", "-u", "-B", "-"], scratch
            else:
                head = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS] if plat.level == "namespace" else []
                spec = _spec(plat.level, scratch, self.python, env, self.disk_bytes, self.max_processes, w)
                argv, cwd = [*head, self.python, "-I", "-c", _supervisor_source(), spec], scratch
            kwargs: dict[str, Any] = (
                {"user": plat.user[0], "group": plat.user[1], "extra_groups": []} if plat.user else {}
            )
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=cwd,
                env=dict(env, TMPDIR=scratch) if plat.level == "basic" else {"PATH": env.get("PATH", "/usr/bin:/bin")},
                start_new_session=True,
                preexec_fn=_preexec(self.rlimits),
                pass_fds=(w,),
                **kwargs,
            )
            os.close(w)
            w = -1
            proc.stdin.write(code)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.drain()  # the program may die before reading all of itself; its status says why
            proc.stdin.close()
            out = await _read_capped(proc.stdout, max_output)
            flooded = len(out) > max_output
            if flooded:
                await self._stop(proc)
            code_ = await proc.wait()
            if plat.level == "basic":  # what is left of its process group goes with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            status = _read_status(r) if plat.level != "basic" else {"exit": code_}
            return CallResult(out, flooded, status.get("exit"), status.get("why"))
        finally:
            if proc is not None and proc.returncode is None:  # cancelled (timeout) or failed mid-way
                await asyncio.shield(self._stop(proc))
            os.close(r)
            if w >= 0:
                os.close(w)
            shutil.rmtree(scratch, ignore_errors=True)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """End the call: the namespace with its supervisor (one SIGKILL ends them all); the plain supervisor is
        asked first (SIGTERM: it kills the descendants it reaped), then the whole session is killed."""
        if self.platform.level == "plain":
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 2.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _read_status(fd: int) -> dict[str, Any]:
    raw = b""
    with contextlib.suppress(BlockingIOError):
        os.set_blocking(fd, False)
        while chunk := os.read(fd, 65536):
            raw += chunk
    try:
        return json.loads(raw.decode().splitlines()[0]) if raw.strip() else {}
    except ValueError:
        return {}


def _preexec(limits: list[tuple[int, int, int]]):
    """The child's pre-exec step: only `setrlimit` calls (nothing that takes a lock the forking parent may hold).
    Limits never go above the hard limits the parent already has."""
    import resource

    def apply() -> None:
        for res, soft, hard in limits:
            _, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            resource.setrlimit(res, (soft, hard))

    return apply


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """Everything until EOF, or the first `cap` + 1 bytes when there is more (the caller then stops the call)."""
    chunks: list[bytes] = []
    total = 0
    while total <= cap:
        chunk = await stream.read(65536)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
