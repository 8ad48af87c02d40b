"""Run one command in a sandbox: the class grader's launcher (see tools/grade_class.py).

    python tools/sandbox.py [--net none] [--pidns] [--uid N] [--mem BYTES] [--nproc N]
                            [--cwd DIR] -- COMMAND...

What it sets up, each part only where the OS allows it (``--probe`` says which):

- ``--net none``: a new network namespace holding only a loopback interface (brought up, so
  gloo on 127.0.0.1 works): nothing outside the machine, nor other processes' sockets, can be
  reached. As root this needs no user namespace; otherwise one is made (as ``unshare -rn``).
- ``--pidns``: a new PID namespace. This launcher's child is its init: when the command ends,
  or the init is killed (the grader kills the launcher's process group on a timeout), the
  kernel kills every process left in the namespace, even ones that left the process group.
- ``--uid N`` (root only): the command runs as user N, which owns nothing in the course, so it
  can neither change the course checkout, the venv, the data nor the grader's files; and
  RLIMIT_NPROC, which root ignores, then bounds the command's processes and threads. N needs
  no passwd entry: LOGNAME, USER, LNAME and USERNAME name it when the environment does not
  (``getpass.getuser()`` reads them first); give it a writable HOME.
- ``--ro PATH`` (repeatable): PATH is read-only for the command (a bind mount in a new mount
  namespace): the course checkout, the venv and the data stay intact even without ``--uid``.
- ``--mem`` (RLIMIT_AS per process), ``--nproc`` (RLIMIT_NPROC), no core files.

It is a separate program started by ``subprocess`` (not a ``preexec_fn``), so the grader can
start many from threads safely. It dies with the thread that started it (``PR_SET_PDEATHSIG``;
with ``--pidns`` its namespace's init too, which ends the namespace): a grader killed even by
SIGKILL leaves no sandbox running. Exit status: the command's, or 128+signal when it was killed.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _mount(src, target, flags) -> None:
    if _libc.mount(src, target.encode() if isinstance(target, str) else target, None,
                   flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def read_only(paths: list[str]) -> None:
    """In this (new) mount namespace: each path becomes a read-only bind mount of itself."""
    _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    for path in paths:
        real = os.path.realpath(path).encode()
        _mount(real, real, MS_BIND | MS_REC)
        _mount(None, real, MS_REMOUNT | MS_BIND | MS_RDONLY)


def enter_namespaces(net: bool, pidns: bool, ro: list[str] | None = None) -> None:
    """unshare the network, PID and mount namespaces asked for (and a user namespace when
    not root), bring up loopback, make ``ro`` read-only."""
    flags = ((CLONE_NEWNET if net else 0) | (CLONE_NEWPID if pidns else 0)
             | (CLONE_NEWNS if ro else 0))
    if not flags:
        return
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        _unshare(flags | CLONE_NEWUSER)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    else:
        _unshare(flags)
    if net:
        loopback_up()
    if ro:
        read_only(ro)


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


PR_SET_PDEATHSIG = 1
IDENTITY_VARS = ("LOGNAME", "USER", "LNAME", "USERNAME")


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when the thread that started it ends (or already has: its pid
    ``parent`` is no longer the parent's; None where that cannot be seen)."""
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if parent is not None and os.getppid() != parent:  # it ended before the line above
        os._exit(128 + signal.SIGKILL)


def limit_and_exec(args, parent: int) -> None:
    """In the final process: rlimits, then the user, then the command (never returns)."""
    try:
        if args.mem:
            resource.setrlimit(resource.RLIMIT_AS, (args.mem, args.mem))
        if args.nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (args.nproc, args.nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if args.cwd:
            os.chdir(args.cwd)
        if args.uid is not None:
            drop_to(args.uid)
            for var in IDENTITY_VARS:  # a uid without a passwd entry still has a name
                os.environ.setdefault(var, f"uid{args.uid}")
            die_with_parent(parent)  # changing the user cleared it
        os.execvpe(args.command[0], args.command, os.environ)
    except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure
        print(f"sandbox: error: could not start {args.command[0]}: {exc}", file=sys.stderr)
        os._exit(96)


PR_SET_KEEPCAPS = 8
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
CAP_DAC_READ_SEARCH = 2
_CAP_VERSION_3 = 0x20080522


def drop_to(uid: int) -> None:
    """Become ``uid`` (and its group), keeping one capability: reading any file.

    The interpreter may live where only root can read (a pyenv under /root, mode 0700), so
    the user keeps CAP_DAC_READ_SEARCH (read and search, never write) across exec as an
    ambient capability. Writing anything it does not own stays forbidden.
    """
    os.setgroups([])
    _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgid(uid)
    os.setuid(uid)
    bit = 1 << CAP_DAC_READ_SEARCH
    header = struct.pack("Ii", _CAP_VERSION_3, 0)
    data = struct.pack("6I", bit, bit, bit, 0, 0, 0)  # effective, permitted, inheritable x2
    if _libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_RAISE)")


def _status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def run(args) -> int:
    try:
        die_with_parent(None)
        enter_namespaces(args.net == "none", args.pidns, args.ro)
    except OSError as exc:
        print(f"sandbox: error: cannot make the namespaces asked for: {exc}", file=sys.stderr)
        return 95
    if not args.pidns:
        limit_and_exec(args, os.getppid())
    init = os.fork()  # the first child of unshare(CLONE_NEWPID) is the namespace's init
    if init:
        _, status = os.waitpid(init, 0)
        return _status(status)
    die_with_parent(None)  # seen from the new namespace, its parent's pid is 0
    main = os.fork()
    if main == 0:
        limit_and_exec(args, 1)
    code = 1
    while True:  # init: reap everything; when the command ends, leave (the kernel kills the rest)
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == main:
            code = _status(status)
            break
    os._exit(code)


def probe() -> dict:
    """Which isolation this machine allows: each tried in a throwaway child."""
    def attempt(fn) -> str:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                fn()
                msg = "ok"
            except BaseException as exc:  # noqa: BLE001
                msg = f"{type(exc).__name__}: {exc}"
            os.write(w, msg.encode()[:500])
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            msg = f.read()
        os.waitpid(pid, 0)
        return msg or "failed"

    def drop():
        drop_to(65534)

    return {"root": os.geteuid() == 0,
            "net": attempt(lambda: enter_namespaces(True, False)),
            "pidns": attempt(lambda: enter_namespaces(False, True)),
            "ro": attempt(lambda: enter_namespaces(False, False, [os.path.dirname(__file__)])),
            "uid": attempt(drop) if os.geteuid() == 0 else "not root: runs as the grader's user"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", action="store_true", help="print what this machine allows")
    parser.add_argument("--net", choices=["host", "none"], default="host")
    parser.add_argument("--pidns", action="store_true")
    parser.add_argument("--uid", type=int, default=None)
    parser.add_argument("--mem", type=int, default=0, help="RLIMIT_AS in bytes, per process")
    parser.add_argument("--nproc", type=int, default=0, help="RLIMIT_NPROC")
    parser.add_argument("--cwd", default=None)
    parser.add_argument("--ro", action="append", default=[],
                        help="make this folder read-only for the command (a mount namespace)")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe()))
        return 0
    if not args.command:
        parser.error("no command given")
    if args.uid is not None and os.geteuid() != 0:
        parser.error("--uid needs root")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
