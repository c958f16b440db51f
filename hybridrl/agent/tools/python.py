"""`python`: run a snippet of Python in a child process and return what it printed.

NOT A SECURITY BOUNDARY. The child runs as the same user as the trainer, on the same machine, with the same
filesystem and network. What it does get: an empty temporary working directory (deleted afterwards), an
environment with nothing inherited (no HOME, no tokens or keys from the parent's environment, PATH=/usr/bin:/bin),
isolated mode (`python -I`: no PYTHON* variables, no user site-packages), its own session (the whole process group is
killed when the call ends or times out), and rlimits set before it starts: CPU seconds, address space (memory),
the size of files it writes, open files, no core dumps. This stops runaway code — infinite loops, memory bombs,
output floods — from hurting the run; it does not stop code that means harm (reading files, opening sockets).
For untrusted models or data, run code in an external sandbox service instead (`sandbox_fusion`, or your own tool
class that posts the code to a URL — see `hybridrl.agent.tools.remote`).
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import sys
import tempfile
from typing import Any

from hybridrl.agent.tools.base import Tool, ToolError

_SCRUBBED_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _limits(cpu_seconds: int, memory_mb: int, file_mb: int, open_files: int) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) triples applied in the child before it runs the code. The CPU hard limit is one
    second above the soft one, so the child first gets SIGXCPU (and the error can say why) before SIGKILL."""
    mb = 1024 * 1024
    return [
        (resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),
        (resource.RLIMIT_AS, memory_mb * mb, memory_mb * mb),
        (resource.RLIMIT_FSIZE, file_mb * mb, file_mb * mb),
        (resource.RLIMIT_NOFILE, open_files, open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]


def _preexec(limits: list[tuple[int, int, int]]):
    """The child's pre-exec step: only `setrlimit` calls (nothing that takes a lock the forking parent may hold).
    Limits never go above the hard limits the parent already has."""

    def apply() -> None:
        for res, soft, hard in limits:
            _, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            resource.setrlimit(res, (soft, hard))

    return apply


def _describe_exit(code: int) -> str:
    if code < 0:
        sig = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed)", "SIGXFSZ": " (file size limit)"}.get(sig, "")
        return f"killed by signal {sig}{why}"
    return f"exit code {code}"


class PythonTool(Tool):
    """Python code in a child process with rlimits and a scrubbed environment (see the module docstring: this is
    not a security boundary). The wall-clock limit is the loop's `agent.tool_timeouts.python` / `tool_timeout_s`:
    when it passes, the call is cancelled and the child's process group is killed."""

    name = "python"
    description = (
        "Run Python 3 code and return what it prints (stdout and stderr). Each call starts fresh: no state is kept "
        "between calls. Use print() to see results."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python program to run."}},
        "required": ["code"],
    }

    def __init__(
        self,
        cpu_seconds: int = 10,
        memory_mb: int = 1024,
        file_mb: int = 16,
        open_files: int = 64,
        max_output_bytes: int = 65536,
        python: str | None = None,
    ) -> None:
        """Limits of one call: CPU seconds, address space and written-file size in MiB, open files, bytes of output
        read back (the child is killed when it prints more). `python`: the interpreter (default: this one)."""
        for key, value in (
            ("cpu_seconds", cpu_seconds),
            ("memory_mb", memory_mb),
            ("file_mb", file_mb),
            ("open_files", open_files),
            ("max_output_bytes", max_output_bytes),
        ):
            if int(value) < 1:
                raise ValueError(f"agent.tool_options.python.{key} must be >= 1, got {value}")
        self.limits = _limits(int(cpu_seconds), int(memory_mb), int(file_mb), int(open_files))
        self.max_output_bytes = int(max_output_bytes)
        self.python = python or sys.executable

    async def acall(self, arguments: dict[str, Any]) -> str:
        code = arguments["code"]
        workdir = tempfile.mkdtemp(prefix="hybridrl-python-")
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                # -I: isolated (ignores PYTHON* variables, no user site); -u: unbuffered, so stdout and stderr
                # interleave as written; -B: no .pyc files; -: the program comes on stdin (the cwd stays empty).
                self.python,
                "-I",
                "-u",
                "-B",
                "-",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=workdir,
                env=dict(_SCRUBBED_ENV),
                start_new_session=True,
                preexec_fn=_preexec(self.limits),
            )
            proc.stdin.write(code.encode("utf-8", errors="replace"))
            try:
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the child died before reading all of its program; its exit status says why
            proc.stdin.close()
            out = await _read_capped(proc.stdout, self.max_output_bytes)
            flooded = len(out) > self.max_output_bytes
            if flooded:
                _kill_group(proc)
            code_ = await proc.wait()
        finally:
            if proc is not None and proc.returncode is None:  # cancelled (timeout) or failed mid-way
                _kill_group(proc)
                await proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
        text = out[: self.max_output_bytes].decode("utf-8", errors="replace")
        if flooded:
            raise ToolError(f"output longer than {self.max_output_bytes} bytes; the program was stopped:\n{text}")
        if code_ != 0:
            raise ToolError(f"{_describe_exit(code_)}\n{text}".rstrip())
        return text if text.strip() else "(no output; print() the values you want to see)"


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """Everything until EOF, or the first `cap` + 1 bytes when there is more (the caller then kills the child)."""
    chunks: list[bytes] = []
    total = 0
    while total <= cap:
        chunk = await stream.read(65536)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
