"""The supervisor between the `python` tool and the code it runs (standard library only: it runs as `python -I -c`).

The tool starts it with one JSON argument; it sets up the sandbox, runs the program (from its stdin) in a child,
waits, kills every process the program left, and writes one JSON line of status to `status_fd`::

    mode "namespace" (started by `unshare --user --map-root-user --pid --fork --kill-child --mount-proc`, so it is
                      pid 1 of a fresh PID namespace, root of a fresh user and mount namespace):
        every mount read-only (mount_setattr, recursive; /proc stays as mounted)
        a tmpfs of `disk_bytes` at `scratch`: work/ (the program's cwd), tmp/ (TMPDIR), shm/ (bound on /dev/shm)
        RLIMIT_NPROC = `max_processes` (counted in this user namespace only)
        the child: a nested user + mount namespace (its mounts locked: it cannot unmount /proc or the tmpfs, nor
        make anything writable again), then the program
        after the child: kill(-1, SIGKILL) ends every process of the namespace; when this process exits the kernel
        kills whatever is left (pid 1 of a namespace takes it all with it)
    mode "plain" (no namespaces on this platform):
        child subreaper (orphaned descendants are reparented here, not to init)
        RLIMIT_NPROC = the user's processes now + `max_processes` (where the kernel enforces it: not for root)
        the child in `scratch`/work with TMPDIR there; every 0.1 s the folder's size is checked against
        `disk_bytes` and the program is stopped past it
        after the child, or on SIGTERM: every descendant killed, repeatedly, until none is left

Status: {"exit": code (negative: the signal), "why": null | "disk" | "terminated", "readonly": bool}.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
MS_BIND = 4096
MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD = 0x1, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # the same number on every Linux architecture (syscalls added since 5.1 share one table)


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def read_only_everywhere(libc: ctypes.CDLL) -> bool:
    """Every mount of this mount namespace read-only, /proc as it was; False where the kernel cannot (before 5.12)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
        return False
    back = _MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)  # /proc writable as mounted: the child writes its uid map there
    libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/proc", 0, ctypes.byref(back), ctypes.sizeof(back))
    return True


def scratch_tmpfs(libc: ctypes.CDLL, scratch: str, disk_bytes: int) -> None:
    """One tmpfs of `disk_bytes` at `scratch` holding the cwd, TMPDIR and /dev/shm, so they share one quota."""
    opts = f"size={max(disk_bytes, 4096)},mode=0755".encode()
    _check(libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", 0, opts), f"mount tmpfs on {scratch}")
    for sub in ("work", "tmp", "shm"):
        os.mkdir(os.path.join(scratch, sub))
    if os.path.isdir("/dev/shm"):
        libc.mount(os.path.join(scratch, "shm").encode(), b"/dev/shm", None, MS_BIND, None)


def _nested_namespace() -> None:
    """In the child before exec: a user + mount namespace of its own, so every mount it inherits is locked."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _user_tasks(uid: int) -> int:
    """Threads and processes of `uid` now (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _children(pid: int) -> list[int]:
    """The direct children of `pid`."""
    found = []
    for task in os.listdir("/proc"):
        if task.isdigit():
            try:
                with open(f"/proc/{task}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(task))
    return found


def kill_descendants() -> None:
    """SIGKILL every descendant of this process (a subreaper: orphans come back here), until none is left."""
    me, quiet = os.getpid(), 0
    while quiet < 2:
        kids = _children(me)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        quiet = 0 if kids else quiet + 1
        time.sleep(0.01)


def _folder_bytes(path: str) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def main(spec: dict) -> dict:
    mode, scratch = spec["mode"], spec["scratch"]
    libc = _libc()
    status = {"exit": None, "why": None, "readonly": False}
    env = dict(spec["env"])
    if mode == "namespace":
        status["readonly"] = read_only_everywhere(libc)
        scratch_tmpfs(libc, scratch, spec["disk_bytes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))
        preexec = _nested_namespace
    else:
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
        for sub in ("work", "tmp"):
            os.mkdir(os.path.join(scratch, sub))
        if os.getuid() != 0:
            limit = _user_tasks(os.getuid()) + spec["max_processes"]
            resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        preexec = None
    env["TMPDIR"] = os.path.join(scratch, "tmp")
    stop = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(signal=True))
    child = subprocess.Popen(
        [spec["python"], "-I", "-u", "-B", "-"],
        cwd=os.path.join(scratch, "work"),
        env=env,
        preexec_fn=preexec,
        close_fds=True,
    )
    if mode == "namespace":  # the tmpfs bounds the disk; the tool ends the namespace from outside on a timeout
        status["exit"] = child.wait()
    while status["exit"] is None:
        pid, code = os.waitpid(child.pid, os.WNOHANG)
        if pid:
            status["exit"] = os.waitstatus_to_exitcode(code)
            break
        if stop["signal"]:
            status["why"] = "terminated"
        elif _folder_bytes(scratch) > spec["disk_bytes"]:
            status["why"] = "disk"
        if status["why"]:
            child.kill()
            status["exit"] = child.wait()
            break
        time.sleep(0.05)
    if mode == "namespace":
        try:
            os.kill(-1, signal.SIGKILL)  # pid 1 of the namespace: every other process in it
        except ProcessLookupError:
            pass
    else:
        kill_descendants()
    return status


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    _fd = _spec["status_fd"]
    try:
        _status = main(_spec)
    except BaseException as e:  # noqa: BLE001 - the tool reads why the sandbox could not start
        _status = {"exit": None, "why": f"sandbox: {type(e).__name__}: {e}", "readonly": False}
    os.write(_fd, (json.dumps(_status) + "\n").encode())
    os._exit(0)
