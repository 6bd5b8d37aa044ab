"""Users' scripts run as users run them: written to a file, started with ``python script.py``, its
output piped (as ``python script.py | tail``), and every process it made found afterwards.

Each run carries a tag in its environment; every process the script starts inherits it (the fork
server and its children, and what those start), so the processes left behind are found without
knowing their pids or their process groups (children lead groups of their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 60.0  # a wait for failure, not a timing: what should be gone within seconds


def force_switch_lines() -> str:
    """Lines a script starts with so that its ``processes=None`` loaders switch to two children
    at their second batch (``tests/switching.py``, without pytest's fixture)."""
    return textwrap.dedent("""
        import pytest as _pytest
        from tests.switching import force_switch as _force_switch
        _force_switch(_pytest.MonkeyPatch())
    """)


class Script:
    """A script written to ``folder``, run piped; ``marks``: where its processes leave files."""

    def __init__(self, folder: Path, text: str) -> None:
        self.path = folder / "train.py"
        self.marks = folder / "marks"
        self.marks.mkdir()
        self.path.write_text(textwrap.dedent(text).replace("{marks}", repr(str(self.marks))))
        self.tag = uuid.uuid4().hex
        self.process: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        env = {**os.environ, "ASYNCLOAD_TEST_RUN": self.tag,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen([sys.executable, str(self.path)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                        cwd=ROOT)
        return self.process

    def tell(self, line: str) -> None:
        """Writes ``line`` to the script's stdin: an event a script waits on (``input()``)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def run(self) -> tuple[int, str, str]:
        """Runs it to the end of its output (every holder of the pipe gone, as ``| tail`` waits)."""
        process = self.start()
        out, err = process.communicate(timeout=BOUND_S * 3)
        return process.returncode, out, err

    def marked(self, prefix: str) -> set[int]:
        """The pids that left a mark named ``<prefix>-<pid>``."""
        return {int(path.name.split("-")[-1]) for path in self.marks.glob(f"{prefix}-*")}

    def processes(self) -> list[psutil.Process]:
        """Every live process that carries this run's tag (zombies excluded: they hold nothing)."""
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get("ASYNCLOAD_TEST_RUN") == self.tag and \
                        process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def left_alive(self) -> list[psutil.Process]:
        """The tagged processes still alive ``BOUND_S`` after this call at the most (it returns as
        soon as none is)."""
        _, alive = psutil.wait_procs(self.processes(), timeout=BOUND_S)
        return [process for process in alive if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]

    def kill_all(self) -> None:
        """Cleanup after a failed test: nothing of the run survives it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
        for process in self.processes():
            try:
                process.kill()
            except psutil.Error:
                pass
