"""No child outlives the script, however it ends (``procs/lifetime.py``, ``procs/server.py``).

A script's loader runs on two children (``processes=2``, or the default made to switch to them)
whose decodes are busy in user code for ever: one waits on an event, one holds the GIL in turns
(as a spin in Python does), and each child has started a process of its own (a grandchild, as a
user's DataLoader worker would be). The script then ends: SIGTERM, SIGKILL, ``os._exit``, an exception. Every process it made
must be gone (``tests/scripts.py`` finds them by a tag in their environment), and its piped
output must end (``python script.py | tail`` returns).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.scripts import BOUND_S, Script, force_switch_lines

_started = threading.Lock()
_grandchild: list[subprocess.Popen] = []


def busy_for_ever(i):
    """In the script's own process, and for the first batch (the layout is learnt from its first
    sample): a sample. In a child, after that: start a grandchild once, leave a mark naming both,
    then never return (even samples wait on an event, odd ones hold the GIL as Python code that
    spins would, but asleep in C: a spin burnt a core for each test's whole length)."""
    if os.getpid() == int(os.environ["ASYNCLOAD_TEST_SCRIPT_PID"]) or i < 4:
        return np.full(2, i, np.int64)
    marks = Path(os.environ["ASYNCLOAD_TEST_MARKS"])
    with _started:
        if not _grandchild:
            _grandchild.append(subprocess.Popen(["sleep", "600"]))
            (marks / f"busy-{os.getpid()}-{_grandchild[0].pid}").touch()
    if i % 2 == 0:
        threading.Event().wait()
    hold_the_gil = ctypes.PyDLL(None).usleep  # PyDLL: the GIL is held through each call
    while True:  # a busy decode without the CPU: the GIL taken back every 20 ms, as a spin would
        hold_the_gil(20_000)


SCRIPT = """
    import os, threading, time
    from pathlib import Path
    from asyncload import AsyncLoader
    from tests.test_lifetime import busy_for_ever

    def busy_children():
        return len(list(Path({marks}).glob("busy-*")))

    if __name__ == "__main__":
        os.environ["ASYNCLOAD_TEST_SCRIPT_PID"] = str(os.getpid())
        os.environ["ASYNCLOAD_TEST_MARKS"] = {marks}
        {switch}
        loader = AsyncLoader(list(range(1000)), batch_size=4, shuffle=False, read=False, decode=busy_for_ever,
                             processes={processes}, decode_timeout=600)
        threading.Thread(target=lambda: [batch for batch in loader], daemon=True).start()
        while busy_children() < 2:
            time.sleep(0.05)
        print("busy", flush=True)
        how = {how}
        if how.startswith("SIG"):
            time.sleep(600)  # the test signals it
        input()  # the test has found every process while busy: end now
        if how == "os._exit":
            os._exit(3)
        if how == "exception":
            raise RuntimeError("the training step failed")
"""


def busy_script(tmp_path, processes, how: str) -> Script:
    switch = force_switch_lines().strip().replace("\n", "; ") if processes is None else ""
    return Script(tmp_path, SCRIPT.replace("{switch}", switch).replace("{processes}", repr(processes))
                  .replace("{how}", repr(how)))


ENDINGS = [(how, processes) for how in ("SIGTERM", "SIGKILL", "os._exit") for processes in (None, 2)] + [
    ("exception", 2), ("return", 2)]  # the ways that run Python's exit are the same once children run


@pytest.mark.parametrize("how, processes", ENDINGS)
def test_nothing_outlives_the_script_however_it_ends(tmp_path, processes, how):
    run = busy_script(tmp_path, processes, how)
    script = run.start()
    try:
        assert script.stdout.readline() == "busy\n", script.stderr.read()
        busy = [tuple(int(n) for n in path.name.split("-")[1:]) for path in run.marks.glob("busy-*")]
        assert len(busy) == 2
        alive = {process.pid for process in run.processes()}
        made = {pid for pair in busy for pid in pair}
        assert made <= alive, "the children and their grandchildren were found while busy"
        if how.startswith("SIG"):
            script.send_signal(getattr(signal, how))
        else:
            run.tell("end")
        out, _ = script.communicate(timeout=BOUND_S)  # the pipe ends: nothing holds it any more
        assert script.returncode != 0 or how == "return"
        assert run.left_alive() == []
    finally:
        run.kill_all()


def lifetime_facts(i):
    """A child's pid and whether it leads its process group."""
    return np.array([os.getpid(), os.getpgid(0) == os.getpid()], np.int64)


def test_children_lead_their_groups_and_die_with_the_fork_server_not_with_the_thread_that_made_them():
    """``PR_SET_PDEATHSIG`` follows the thread that forked, not the process: it is set in the
    fork server's children (its one thread forks them), never for the fork server (started from
    whichever thread of this process first needed it). So a loader made on a thread that then
    ends keeps its children; and they end with the fork server, were it killed alone (a new one
    starts for the next loader)."""
    from asyncload import AsyncLoader

    made = []
    thread = threading.Thread(target=lambda: made.append(AsyncLoader(list(range(16)), batch_size=4, read=False,
                                                                     decode=lifetime_facts, processes=2)))
    thread.start()
    thread.join()
    loader = made[0]
    facts = {tuple(int(value) for value in row) for batch in loader for row in batch}
    pids = {pid for pid, _ in facts}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {leads for _, leads in facts} == {1}
    children = [psutil.Process(pid) for pid in pids]
    servers = {child.ppid() for child in children}
    assert len(servers) == 1 and os.getpid() not in servers
    try:
        psutil.Process(servers.pop()).kill()
        _, alive = psutil.wait_procs(children, timeout=BOUND_S)
        assert alive == [], "the children died with the fork server"
    finally:
        loader.close()


def fork_in_decode(i):
    """A decode that forks, as a fork-context Pool or DataLoader in a decode would: the new
    process's exit code, as its parent saw it, and the decoding pid."""
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return np.array([os.waitstatus_to_exitcode(status), os.getpid()], np.int64)


@pytest.mark.parametrize("processes", [0, 2])
def test_a_process_forked_in_a_decode_lives_its_own_life(processes):
    """The fork server's fork hook (``server.py``) is inherited by every child; it must act in
    the fork server's own children only, never kill what a child forks."""
    from asyncload import AsyncLoader

    with AsyncLoader(list(range(8)), batch_size=4, shuffle=False, read=False, decode=fork_in_decode,
                     processes=processes) as loader:
        rows = [tuple(int(value) for value in row) for batch in loader for row in batch]
    assert [code for code, _ in rows] == [7] * 8
    assert ({pid for _, pid in rows} == {os.getpid()}) == (processes == 0)


def gil_held(i):
    """In a child, after the first batch: leave a mark, then hold the GIL in native code (a
    wedged C extension) for longer than the test waits, so that the child's lifeline thread
    cannot run."""
    if os.getpid() == int(os.environ["ASYNCLOAD_TEST_SCRIPT_PID"]) or i < 4:
        return np.full(2, i, np.int64)
    (Path(os.environ["ASYNCLOAD_TEST_MARKS"]) / f"stuck-{os.getpid()}").touch()
    ctypes.PyDLL(None).sleep(int(BOUND_S * 2))  # PyDLL: the GIL is held through the call
    return np.full(2, i, np.int64)


GIL_SCRIPT = """
    import os, threading, time
    from pathlib import Path
    from asyncload import AsyncLoader
    from tests.test_lifetime import gil_held

    if __name__ == "__main__":
        os.environ["ASYNCLOAD_TEST_SCRIPT_PID"] = str(os.getpid())
        os.environ["ASYNCLOAD_TEST_MARKS"] = {marks}
        loader = AsyncLoader(list(range(1000)), batch_size=4, shuffle=False, read=False, decode=gil_held,
                             processes=2, decode_timeout=600)
        threading.Thread(target=lambda: [batch for batch in loader], daemon=True).start()
        while not list(Path({marks}).glob("stuck-*")):
            time.sleep(0.05)
        print("stuck", flush=True)
        time.sleep(600)  # the test kills it
"""


def test_a_child_holding_the_gil_does_not_outlive_a_killed_script(tmp_path):
    """The child's lifeline thread cannot run while its decode holds the GIL: the fork server's
    backstop must, so the child must not keep the fork server's "alive" pipe open."""
    run = Script(tmp_path, GIL_SCRIPT)
    script = run.start()
    try:
        assert script.stdout.readline() == "stuck\n", script.stderr.read()
        assert run.marked("stuck") <= {process.pid for process in run.processes()}
        script.send_signal(signal.SIGKILL)
        script.wait(timeout=BOUND_S)  # not its output's end: a child left alive would hold it
        assert run.left_alive() == []
    finally:
        run.kill_all()
