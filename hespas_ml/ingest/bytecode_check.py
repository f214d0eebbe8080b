"""A child process that parses untrusted MLIR bytecode before the ingesting process does.

MLIR's bytecode reader is not hardened against damaged input: it can abort or corrupt its heap. The
checker child (:data:`CHECKER`, started on first use) takes that risk; :mod:`hespas_ml.ingest.stablehlo`
parses bytecode itself only after the child parsed it cleanly.
"""
from __future__ import annotations

import atexit
import os
import selectors
import subprocess
import sys
import threading
from pathlib import Path

from .bindings import describe_mlir_error, mlir


class BytecodeChecker:
    """A child process that parses untrusted MLIR bytecode before this process does.

    MLIR's bytecode reader is not hardened: damaged bytecode can abort it or corrupt its heap. The
    child (started on first use, reused afterwards, restarted after a crash) takes that risk; a crash or
    time-out becomes an error message. Input the child parsed cleanly parses cleanly here too.
    """

    TIMEOUT_S = 5.0                  # per check, plus TIMEOUT_S_PER_MB (healthy bytecode reads at >50 MB/s)
    TIMEOUT_S_PER_MB = 2.0
    START_TIMEOUT_S = 120.0          # importing jax in the child
    MEMORY_LIMIT = 4 << 30           # address space of the child (or 64 x the bytecode, if larger)

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.timed_out = False

    def check(self, data: bytes) -> str | None:
        """None when ``data`` is safe to parse in this process; else why it is rejected."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                if not self._start():
                    return "cannot check MLIR bytecode: the checker process did not start"
            try:
                self.proc.stdin.write(len(data).to_bytes(8, "little") + data)
                self.proc.stdin.flush()
            except OSError:
                pass                      # it died reading: _reply sees the end of its output
            limit = self.TIMEOUT_S + self.TIMEOUT_S_PER_MB * len(data) / 1e6
            reply = self._reply(limit)
            if reply is not None:
                return None if reply == "OK" else reply
            how = self._stop()
            if how == "timeout":
                return f"MLIR bytecode could not be read within {limit:.0f} s (damaged?)"
            return f"MLIR bytecode is damaged (MLIR's bytecode reader crashed on it: {how})"

    def _start(self) -> bool:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        env.setdefault("JAX_PLATFORMS", "cpu")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from hespas_ml.ingest.bytecode_check import serve_bytecode_checks; "
             "serve_bytecode_checks()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        if self._reply(self.START_TIMEOUT_S) == "READY":
            return True
        self._stop()
        return False

    def _reply(self, timeout: float) -> str | None:
        """The child's next ``@@`` line; None when it died or did not answer within ``timeout`` s."""
        proc = self.proc
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                if not sel.select(timeout=timeout):
                    self.timed_out = True
                    return None
                line = proc.stdout.readline()
                if not line:
                    return None
                if line.startswith(b"@@ "):
                    return line[3:].decode("utf-8", "replace").strip()

    def _stop(self) -> str:
        """End the child; says how it ended ("timeout", "signal 6", "exit status 1")."""
        proc, self.proc = self.proc, None
        timed_out, self.timed_out = self.timed_out, False
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if timed_out:
            return "timeout"
        return f"signal {-code}" if code < 0 else f"exit status {code}"

    def close(self) -> None:
        with self.lock:
            if self.proc is not None:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=5)
                except Exception:
                    self.proc.kill()
                    self.proc.wait()
                self.proc.stdout.close()
            self.proc = None


def serve_bytecode_checks() -> None:
    """Entry point of the checker child: length-prefixed bytecode in, one ``@@ OK|<error>`` line out."""
    import resource

    die_with_parent()
    jmlir, ir, _ = mlir()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"@@ READY\n")
    stdout.flush()
    while True:
        header = stdin.read(8)
        if len(header) < 8:
            return
        data = stdin.read(int.from_bytes(header, "little"))
        # A reader stuck in a loop ends itself (SIGXCPU) even if nobody is left to kill it, and one
        # allocating without bound fails (abort) instead of exhausting the machine.
        _set_soft_limit(resource.RLIMIT_CPU, _cpu_seconds() + 60 + 8 * len(data) / 1e6)
        _set_soft_limit(resource.RLIMIT_AS, max(BytecodeChecker.MEMORY_LIMIT, 64 * len(data)))
        with jmlir.make_ir_context():
            try:
                module = ir.Module.parse(data)
                reply = "OK" if _names_are_text(module, ir) else \
                    "MLIR bytecode holds names or strings that are not UTF-8 (damaged?)"
            except ir.MLIRError as exc:
                reply = describe_mlir_error(exc)
            except Exception as exc:
                first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
                reply = f"not a valid MLIR module ({first})"
        stdout.write(b"@@ " + reply.replace("\n", " ").encode("utf-8", "replace") + b"\n")
        stdout.flush()


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _set_soft_limit(which: int, value: float) -> None:
    import resource

    try:
        _, hard = resource.getrlimit(which)
        soft = int(value) + 1
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass


def _names_are_text(module, ir) -> bool:
    """Whether every attribute name and string of ``module`` converts to Python text (checker child
    only: on damaged bytecode the conversion can abort the process)."""
    ok = True

    def visit(op):
        nonlocal ok
        try:
            for _, attr in op.attributes.items():
                if isinstance(attr, (ir.StringAttr, ir.FlatSymbolRefAttr)):
                    attr.value
        except (RuntimeError, UnicodeDecodeError):
            ok = False
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return ok


CHECKER = BytecodeChecker()
atexit.register(CHECKER.close)
