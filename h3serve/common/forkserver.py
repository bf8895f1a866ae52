"""A fork server: one process imports the model services' modules once (torch, diffusers, transformers: 10-12 s of
CPU each time a Python process imports them), then starts every model process as a fork of itself, so a service or
a rank, and every restart of one, begins with them imported.

The server only imports: it runs no torch operation, touches no GPU and opens no gRPC channel, so a fork of it is
what a fresh interpreter is after the same imports (no thread pool, no CUDA context, no gRPC state). A child runs
`python -m MODULE ARGS` as the interpreter would (`runpy`, `sys.argv`), with the requester's environment, standard
streams and session choice, and its process title reads as that command line.

A child is the server's, not the requester's, so it keeps what a child of the requester has in two other ways:
- its exit status comes back over the connection that asked for it (`Forked` reads like `subprocess.Popen`);
- its parent-death signal is sent by the server when that connection closes (the requester died), and by the kernel
  when the server dies (which dies with the process that started it).
What the server cannot reproduce exactly (another interpreter or working directory, a variable read at import time
that differs: IMPORT_TIME) it refuses, and `start` starts that command as a plain process instead.

Run as `python -m h3serve.common.forkserver FD PRELOADER`: serve on the listening Unix socket FD once the module
PRELOADER's `preload()` has imported what the children will use (h3serve/services/preload.py for the model's).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

from h3serve.common import processes

log = logging.getLogger("h3serve.forkserver")
ENV = "H3SERVE_FORKSERVER"  # the server's socket path, for the processes started below it (the DiT's launcher)
# Variables read while the server imported (by the interpreter, the dynamic loader, torch's configuration modules):
# a child whose value differs would not see its own, so its command starts as a plain process.
IMPORT_TIME = ("PYTHON", "LD_", "TORCH_", "TORCHDYNAMO", "TORCHINDUCTOR", "MKL_", "KMP_", "GOMP_", "OPENBLAS_")
RUN_TIME = {"TORCH_SYMM_MEM_DISABLE_MULTICAST"}  # among those, read only when a process group first uses it
# OpenMP reads it when torch loads; a child applies its own value again (torch.set_num_threads), as torchrun's ranks
# sharing a host's cores each take one.
THREADS = "OMP_NUM_THREADS"
ACCEPT_TIMEOUT_S = 10.0  # a requester sends its request right after connecting
STREAMS = 3  # stdin, stdout, stderr: passed with every request


class _Messages:
    """Newline-delimited JSON over a Unix stream socket; the first message may carry descriptors."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode() + b"\n"
        if fds:
            socket.send_fds(self.conn, [data], fds)
        else:
            self.conn.sendall(data)

    def receive(self, fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
        """The next message (None at the end of the stream) and the descriptors that came with it."""
        received: list[int] = []
        while b"\n" not in self.buffer:
            if fds and not received:
                data, got, _, _ = socket.recv_fds(self.conn, 1 << 20, fds)
                received = list(got)
            else:
                data = self.conn.recv(1 << 20)
            if not data:
                return None, received
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line), received


# The server's side.


@dataclass
class _Child:
    pid: int
    pidfd: int
    messages: _Messages | None  # None once its requester has gone
    death_signal: int


_started_with: dict[str, str] = {}  # the server's environment before it imported
_imports_set: dict[str, str] = {}  # what the imports set in it (torch: TORCHINDUCTOR_CACHE_DIR's default)


def _refusal(request: dict[str, Any]) -> str:
    """Why this server cannot start `request` as the interpreter would; "" when it can."""
    if request["executable"] != sys.executable:
        return f"another interpreter ({request['executable']})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised while this server imported: no fork of it could use a GPU"
    if request["cwd"] != os.getcwd():
        return f"another working directory ({request['cwd']})"
    env, own = request["env"], _started_with
    differ = {
        key
        for key in (env.keys() | own.keys()) - RUN_TIME
        if key.startswith(IMPORT_TIME) and env.get(key) not in (own.get(key), _imports_set.get(key, own.get(key)))
    }  # a value the imports set is one the child's own imports would have set (its starter imported torch too)
    return f"variables read at import time differ: {', '.join(sorted(differ))}" if differ else ""


def serve(listener: socket.socket) -> tuple[str, list[str]]:
    """Fork a child for each request, report its pid and later its exit status, and send its death signal when its
    requester goes. Returns only in a child, with the module and arguments it is to run."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                run = _accept(listener, selector)
                if run:
                    return run
            elif key.fileobj == key.data.pidfd:
                _reap(key.data, selector)
            else:
                _requester_spoke(key.data, selector)


def _accept(listener: socket.socket, selector: selectors.BaseSelector) -> tuple[str, list[str]] | None:
    """Read one request and fork its child; in the child, what to run."""
    conn, _ = listener.accept()
    conn.settimeout(ACCEPT_TIMEOUT_S)
    messages = _Messages(conn)
    fds: list[int] = []
    try:
        request, fds = messages.receive(fds=STREAMS)
        refusal = "an incomplete request" if request is None or len(fds) != STREAMS else _refusal(request)
        if refusal:
            with contextlib.suppress(OSError):
                messages.send({"refused": refusal})
            conn.close()
            return None
        assert request is not None
        server = os.getpid()
        pid = _fork()
        if pid == 0:
            for key in list(selector.get_map().values()):
                _close(key.fileobj)
            selector.close()
            conn.close()
            return _become(request, fds, server)
    except OSError:  # the requester went before its request was read
        conn.close()
        return None
    finally:  # the child has its copies on 0, 1 and 2 by now
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    child = _Child(pid, os.pidfd_open(pid), messages, int(request["death_signal"]))
    conn.settimeout(None)
    selector.register(conn, selectors.EVENT_READ, child)
    selector.register(child.pidfd, selectors.EVENT_READ, child)
    with contextlib.suppress(OSError):
        messages.send({"pid": pid})
    return None


def _fork() -> int:
    """os.fork() without Python 3.12's warning that the process is multi-threaded: the server's only other threads are
    numpy's OpenBLAS workers (started when numpy loads, idle between calls), and OpenBLAS's own fork handlers stop and
    restart them around a fork, so no lock of theirs is held in a child."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"This process \(pid=\d+\) is multi-threaded", category=DeprecationWarning
        )
        return os.fork()


def _close(fileobj: Any) -> None:
    with contextlib.suppress(OSError):
        fileobj.close() if hasattr(fileobj, "close") else os.close(fileobj)


def _reap(child: _Child, selector: selectors.BaseSelector) -> None:
    """The child ended: its status to its requester, if still there."""
    _, status = os.waitpid(child.pid, 0)
    selector.unregister(child.pidfd)
    os.close(child.pidfd)
    if child.messages:
        with contextlib.suppress(OSError):
            child.messages.send({"returncode": os.waitstatus_to_exitcode(status)})
        selector.unregister(child.messages.conn)
        child.messages.conn.close()
        child.messages = None


def _requester_spoke(child: _Child, selector: selectors.BaseSelector) -> None:
    """A requester only ever closes its connection: it is gone, and its child gets its death signal."""
    assert child.messages is not None
    conn = child.messages.conn
    with contextlib.suppress(OSError):
        if conn.recv(1 << 12):
            return
    selector.unregister(conn)
    conn.close()
    child.messages = None
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, child.death_signal)


def _become(request: dict[str, Any], fds: list[int], server: int) -> tuple[str, list[str]]:
    """In the fork: take on the request's session, death signal, streams, directory, environment and title."""
    if request["new_session"]:
        os.setsid()
    processes.set_parent_death_signal(int(request["death_signal"]))
    if os.getppid() != server:  # the server died before prctl: the signal will never come
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    _reopen_streams()
    _set_title(" ".join(request["argv"]))  # first: it finds the space to write in from the environment it started with
    os.environ.clear()
    os.environ.update(request["env"])
    # what the imports set, as they would have set it in a plain start (unless the request sets it otherwise)
    os.environ.update({k: v for k, v in _imports_set.items() if request["env"].get(k) == _started_with.get(k)})
    torch = sys.modules.get("torch")
    if torch is not None and THREADS in os.environ:
        torch.set_num_threads(int(os.environ[THREADS]))
    return request["argv"][2], request["argv"][3:]


def _reopen_streams() -> None:
    """sys.stdin, stdout and stderr as the interpreter opens them on the new 0, 1 and 2 (a terminal's stdout is
    line-buffered, a file's is not)."""
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the interpreter's own streams, open for the process's life)
    sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115


def _set_title(title: str) -> None:
    """What ps and /proc/PID/cmdline show: the command line a plain start would have had."""
    try:
        import setproctitle
    except ImportError:  # the model extra installs it; without it the children read as the server
        return
    setproctitle.setproctitle(title)


def _preload(preloader: str) -> None:
    """Run `preloader`'s `preload()` (the imports), its notices silenced (each child's log stays its own)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = [os.dup(1), os.dup(2)]
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        importlib.import_module(preloader).preload()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.close(devnull)


def main() -> None:
    listener = socket.socket(fileno=int(sys.argv[1]))
    _started_with.update(os.environ)
    _preload(sys.argv[2])
    _imports_set.update({k: v for k, v in os.environ.items() if _started_with.get(k) != v})
    gc.freeze()  # what was imported stays out of every collection: a child's collections copy none of its pages
    module, args = serve(listener)
    sys.argv = [sys.argv[0], *args]  # runpy puts the module's path first, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# The requester's side.


class Forked:
    """A child of the server, read like the `subprocess.Popen` of a plain start: pid, returncode, poll, wait,
    send_signal, terminate, kill. Dropping it closes its connection, and the server then sends its death signal."""

    def __init__(self, args: list[str], messages: _Messages, pid: int, death_signal: int) -> None:
        self.args, self.messages, self.pid, self.death_signal = args, messages, pid, death_signal
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.messages.conn], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.messages.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read()
        assert self.returncode is not None
        return self.returncode

    def _read(self) -> None:
        message, _ = self.messages.receive()
        # No message: the server died, and so did its children, each by its parent-death signal.
        self.returncode = message["returncode"] if message else -self.death_signal
        self.messages.conn.close()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The requester's handle on a server: the one it started (`launch`), or one started above it (`from_env`)."""

    def __init__(self, path: str, process: subprocess.Popen | None = None) -> None:
        self.path, self.process = path, process

    @classmethod
    def launch(cls, preloader: str) -> ForkServer:
        """Start a server that runs `preloader`'s `preload()`; it dies with the calling thread. Requests wait while it
        imports."""
        directory = tempfile.mkdtemp(prefix="h3serve-fork-")
        path = os.path.join(directory, "socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(64)
            process = processes.spawn(
                [sys.executable, "-m", "h3serve.common.forkserver", str(listener.fileno()), preloader],
                death_signal=signal.SIGKILL,
                pass_fds=[listener.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the terminal is the launcher's to act on, not the server's
            )
        return cls(path, process)

    @classmethod
    def from_env(cls) -> ForkServer | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def stop(self) -> None:
        """Stop a server this process launched (its children are stopped first, by their owners)."""
        if self.process:
            self.process.kill()
            self.process.wait()
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def fork(
        self,
        argv: list[str],
        death_signal: int,
        env: dict[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        start_new_session: bool = False,
    ) -> Forked | None:
        """`argv` (`python -m MODULE ...`) as a fork of the server; None where it cannot be (the server is gone, or
        refused it): the caller then starts it plainly."""
        if argv[1:2] != ["-m"]:
            return None
        request = dict(
            argv=argv,
            executable=argv[0],
            cwd=os.getcwd(),
            env=dict(os.environ if env is None else env),
            new_session=start_new_session,
            death_signal=int(death_signal),
        )
        with contextlib.ExitStack() as opened:
            out = _descriptor(stdout, 1, opened)
            err = out if stderr == subprocess.STDOUT else _descriptor(stderr, 2, opened)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.path)
                messages = _Messages(conn)
                messages.send(request, [0, out, err])
                reply, _ = messages.receive()
            except OSError:
                conn.close()
                return None
        if not reply or "pid" not in reply:
            conn.close()
            why = reply["refused"] if reply else "it closed the connection"
            log.warning("the fork server did not start %s (%s): it starts as a plain process", argv[2], why)
            return None
        return Forked(argv, messages, reply["pid"], int(death_signal))


def _descriptor(stream: Any, inherited: int, opened: contextlib.ExitStack) -> int:
    """A Popen stdout or stderr argument as a descriptor number."""
    if stream is None:
        return inherited
    if stream == subprocess.DEVNULL:
        return opened.enter_context(open(os.devnull, "wb")).fileno()
    return stream if isinstance(stream, int) else stream.fileno()


FORKABLE = {"env", "stdout", "stderr", "start_new_session"}  # the Popen options a fork reproduces


def start(
    argv: list[str], server: ForkServer | None, death_signal: int = signal.SIGTERM, **popen: Any
) -> processes.Child:
    """`processes.spawn(argv, death_signal, **popen)`, as a fork of `server` where it can be."""
    forked = server.fork(argv, death_signal, **popen) if server and popen.keys() <= FORKABLE else None
    return forked or processes.spawn(argv, death_signal=death_signal, **popen)


if __name__ == "__main__":
    main()
