"""`python`: run a snippet of Python in a sandboxed child process and return what it printed.

What holds depends on the platform (`hybridrl/agent/tools/sandbox.py` probes it once; the log says which level):

On Linux with user namespaces (most distributions, no root needed), level "namespace":
- every process the code starts (background, `setsid`, double-forked) is killed when the call ends, normally, by an
  error, a timeout or an output flood: the code runs in its own PID namespace, which dies with it;
- at most `max_processes` processes (RLIMIT_NPROC, counted in its own user namespace): a fork loop fails to fork;
- the file system is read-only except one tmpfs of `disk_mb` holding its working folder, TMPDIR and /dev/shm: a
  total-bytes quota, freed when the call ends;
- it sees only its own processes in /proc and can signal no process outside (the trainer included), and cannot
  undo any of this (its mounts are locked by a second, nested user namespace).
On Linux without user namespaces (some containers), level "plain": every descendant is still killed at the end (a
child subreaper sweeps them, `setsid` included); RLIMIT_NPROC is the user's processes plus `max_processes`; the
working folder is stopped past `disk_mb`, but other folders the user can write stay writable, and the code can see
and signal the user's other processes. Elsewhere (macOS), level "basic": the code's process group is killed at the end.

Everywhere: an empty working folder (deleted afterwards); an environment with nothing inherited (no HOME, no tokens
or keys from the parent's environment, PATH=/usr/bin:/bin); isolated mode (`python -I`); rlimits on CPU seconds,
address space, the size of each file written, open files, no core dumps. The trainer's processes are non-dumpable
while this tool is in use, so /proc/<pid>/environ and /proc/<pid>/mem of the trainer are closed to the code even
where it can see them. When the trainer runs as root, the code runs as `nobody`.

What it does NOT promise: reading files is allowed (whatever the user the code runs as can read), and so is the
network (sockets, HTTP). It is not a boundary against kernel exploits. RLIMIT_NPROC is not enforced for root, so a
trainer running as root whose children cannot run as `nobody` gets no process limit (the timeout still ends every
process). For untrusted models or data, run code in an external sandbox service instead (`sandbox_fusion`, or your
own tool class that posts the code to a URL — see `hybridrl.agent.tools.remote`).
"""

from __future__ import annotations

import resource
import signal
import sys
from typing import Any

from hybridrl.agent.tools.base import Tool, ToolError
from hybridrl.agent.tools.sandbox import Sandbox, protect_process

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


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped (no exit status)"
    if code < 0:
        sig = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed)", "SIGXFSZ": " (file size limit)"}.get(sig, "")
        return f"killed by signal {sig}{why}"
    return f"exit code {code}"


class PythonTool(Tool):
    """Python code in a sandboxed child process (see the module docstring for what holds on which platform). The
    wall-clock limit is the loop's `agent.tool_timeouts.python` / `tool_timeout_s`: when it passes, the call is
    cancelled and every process it started is killed."""

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
        disk_mb: int = 64,
        max_processes: int = 32,
        python: str | None = None,
    ) -> None:
        """Limits of one call: CPU seconds, address space and written-file size in MiB, open files, bytes of output
        read back (the call is stopped when it prints more), MiB written in all (`disk_mb`), processes at once
        (`max_processes`). `python`: the interpreter (default: this one)."""
        for key, value in (
            ("cpu_seconds", cpu_seconds),
            ("memory_mb", memory_mb),
            ("file_mb", file_mb),
            ("open_files", open_files),
            ("max_output_bytes", max_output_bytes),
            ("disk_mb", disk_mb),
            ("max_processes", max_processes),
        ):
            if int(value) < 1:
                raise ValueError(f"agent.tool_options.python.{key} must be >= 1, got {value}")
        self.max_output_bytes = int(max_output_bytes)
        self.python = python or sys.executable
        self.sandbox = Sandbox(
            self.python,
            _limits(int(cpu_seconds), int(memory_mb), int(file_mb), int(open_files)),
            int(disk_mb) * 1024 * 1024,
            int(max_processes),
        )
        protect_process()  # this worker's environment and memory closed to the code (reset by exec: once per process)
        self.sandbox.platform  # noqa: B018 - probed now, at start-up, not inside the first call's event loop

    @property
    def level(self) -> str:
        """The sandbox level in use here: namespace, plain or basic."""
        return self.sandbox.platform.level

    async def acall(self, arguments: dict[str, Any]) -> str:
        code = arguments["code"].encode("utf-8", errors="replace")
        result = await self.sandbox.run(code, dict(_SCRUBBED_ENV), self.max_output_bytes)
        text = result.output[: self.max_output_bytes].decode("utf-8", errors="replace")
        if result.flooded:
            raise ToolError(f"output longer than {self.max_output_bytes} bytes; the program was stopped:\n{text}")
        if result.why == "disk":
            mb = self.sandbox.disk_bytes // (1024 * 1024)
            raise ToolError(f"the program wrote more than {mb} MiB (its disk quota) and was stopped\n{text}".rstrip())
        if result.why and result.why != "terminated":
            raise ToolError(f"the sandbox failed: {result.why}\n{text}".rstrip())
        if result.exit != 0:
            raise ToolError(f"{_describe_exit(result.exit)}\n{text}".rstrip())
        return text if text.strip() else "(no output; print() the values you want to see)"
