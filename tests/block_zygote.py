"""A Python process that has imported torch, graphrunner and (when installed) transformers once, and runs
each doc block (``tests/test_docs_examples.py``) in a child forked from it: a fresh interpreter as
``python -c CODE`` gives it (``__main__`` a new module, ``sys.argv == ["-c"]``, the block's own
working directory, its output in files), without paying the imports again for every block.

Run as a script, it reads one JSON request a line on stdin, ``{"code", "cwd", "stdout", "stderr"}``,
forks, and answers two lines on stdout: ``{"pid": N}`` at once, then ``{"status": S}`` (the child's
exit status, or ``-signal``) when the child ends. :class:`Zygote` is the test's side.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback
import types


def _run_child(request: dict) -> int:
    """In the forked child: the block as ``python -c`` runs it; its exit status."""
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the block's stdin, as a -c script without input has
    sys.argv = ["-c"]
    sys.path[0] = ""  # python -c: the working directory first
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # noqa: F401  (the imports every block pays for, paid once)

    import graphrunner  # noqa: F401

    try:
        import transformers  # noqa: F401

        import graphrunner.hf  # noqa: F401
    except ImportError:
        pass
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            status = _run_child(request)
            sys.stdout.flush()
            sys.stderr.flush()
            sys.exit(status)  # the child's interpreter ends as a script's does
        print(json.dumps({"pid": pid}), flush=True)
        _, wait = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(wait)
        print(json.dumps({"status": status}), flush=True)


class Zygote:
    """The test's side: ``Zygote(env)`` starts the process (``env``: its environment); :meth:`run` runs
    one block and returns ``(status, stdout, stderr)``, killing the block's child after ``timeout`` s
    (``TimeoutError``); :meth:`close` ends the process."""

    def __init__(self, env: dict[str, str], start_timeout: float = 120.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self._read(start_timeout)

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the doc block zygote did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the doc block zygote exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, code: str, cwd: str, timeout: float = 120.0) -> tuple[int, str, str]:
        assert self.proc.stdin is not None
        out, err = os.path.join(cwd, ".block.stdout"), os.path.join(cwd, ".block.stderr")
        self.proc.stdin.write(json.dumps({"code": code, "cwd": cwd, "stdout": out, "stderr": err}) + "\n")
        self.proc.stdin.flush()
        pid = self._read(30.0)["pid"]
        try:
            status = self._read(timeout)["status"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(30.0)
            raise TimeoutError(f"the block ran past {timeout:.0f} s (killed)") from None
        with open(out) as f_out, open(err) as f_err:
            return status, f_out.read(), f_err.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)


if __name__ == "__main__":
    main()
