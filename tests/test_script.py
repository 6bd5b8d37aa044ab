"""The user's script is never run again in a child (``procs/script.py``, ``procs/start.py``).

Each script leaves a mark per process that runs its top level (named by pid) and one per
process that decodes; the test then knows what ran where. Scripts are run as users run them
(``tests/scripts.py``): piped, and every process they made must be gone once they end.
"""

from __future__ import annotations

import pytest

from tests.scripts import Script, force_switch_lines

# ----- the scripts -----

UNGUARDED_MODULE_DECODE = """
    import os, pathlib
    from asyncload import AsyncLoader
    from tests.test_procs import pid_sample
    pathlib.Path({marks}, f"top-{os.getpid()}").touch()
    {switch}
    loader = AsyncLoader(list(range(64)), batch_size=4, shuffle=False, read=False, decode=pid_sample,
                         processes={processes})
    pids = set()
    for batch in loader:
        pids.update(int(pid) for pid in batch[:, 1])
    for pid in pids:
        pathlib.Path({marks}, f"decoded-{pid}").touch()
    print("finished", flush=True)
"""

UNGUARDED_MAIN_DECODE = """
    import os, pathlib
    import numpy as np
    from asyncload import AsyncLoader
    pathlib.Path({marks}, f"top-{os.getpid()}").touch()
    {switch}

    def make_item(i):
        pathlib.Path({marks}, f"decoded-{os.getpid()}").touch()
        return np.array([i, os.getpid()], np.int64)

    loader = AsyncLoader(list(range(64)), batch_size=4, shuffle=False, read=False, decode=make_item,
                         processes={processes})
    rows = [int(row[0]) for batch in loader for row in batch]
    assert rows == list(range(64)), rows
    print("finished", loader.stats.processes_choice, flush=True)
"""

GUARDED_MAIN_DECODE = """
    import os, pathlib
    import numpy as np
    from asyncload import AsyncLoader

    def make_item(i):
        pathlib.Path({marks}, f"decoded-{os.getpid()}").touch()
        return np.array([i, os.getpid()], np.int64)

    if __name__ == "__main__":
        pathlib.Path({marks}, f"top-{os.getpid()}").touch()
        {switch}
        loader = AsyncLoader(list(range(64)), batch_size=4, shuffle=False, read=False, decode=make_item,
                             processes={processes})
        rows = [int(row[0]) for batch in loader for row in batch]
        assert rows == list(range(64)), rows
        print("finished", flush=True)
"""

ASSIGNED_WORK = """
    import os, pathlib
    import numpy as np
    from asyncload import AsyncLoader

    def make_item(i):
        pathlib.Path({marks}, f"decoded-{os.getpid()}").touch()
        return np.array([i, os.getpid()], np.int64)

    _mark = open(os.path.join({marks}, f"top-{os.getpid()}"), "w")  # as `ds = download()` would
    if __name__ == "__main__":
        {switch}
        loader = AsyncLoader(list(range(64)), batch_size=4, shuffle=False, read=False, decode=make_item,
                             processes={processes})
        rows = [int(row[0]) for batch in loader for row in batch]
        assert rows == list(range(64)), rows
        print("finished", flush=True)
"""


def script(tmp_path, text: str, processes) -> Script:
    switch = force_switch_lines().strip().replace("\n", "; ") if processes is None else ""
    return Script(tmp_path, text.replace("{switch}", switch).replace("{processes}", repr(processes)))


@pytest.fixture
def cleanup():
    scripts: list[Script] = []
    yield scripts.append
    for each in scripts:
        each.kill_all()


# ----- tests -----


@pytest.mark.parametrize("processes", [None, 2])
def test_an_unguarded_script_whose_decode_is_in_a_module_runs_its_top_level_once(tmp_path, cleanup, processes):
    """The children need nothing of the script: they never import it, and do the decoding."""
    run = script(tmp_path, UNGUARDED_MODULE_DECODE, processes)
    cleanup(run)
    code, out, err = run.run()
    assert code == 0, err
    assert "finished" in out
    assert run.marked("top") == {run.process.pid}, "the script's top level ran in one process only"
    decoders = run.marked("decoded")
    assert len(decoders - {run.process.pid}) == 2, "two children decoded"
    assert run.left_alive() == []


def test_the_default_stays_in_this_process_for_an_unguarded_script_that_defines_the_decode(tmp_path, cleanup):
    run = script(tmp_path, UNGUARDED_MAIN_DECODE, None)
    cleanup(run)
    code, out, err = run.run()
    assert code == 0, err
    assert run.marked("top") == {run.process.pid}, "no child ran the script's top level"
    assert run.marked("decoded") == {run.process.pid}, "it stayed in this process"
    warned = [line for line in err.splitlines() if "RuntimeWarning: asyncload: processes=None stays" in line]
    assert len(warned) == 1, err
    line = warned[0]
    assert "decode= needs make_item from" in line and str(run.path) in line
    assert 'if __name__ == "__main__":' in line and "define make_item in a module" in line
    assert "line 5" in line, "names the first top-level statement that does work"
    assert "child processes cannot be used" in out, "the report's processes line says why too"
    assert run.left_alive() == []


def test_explicit_processes_in_an_unguarded_script_that_defines_the_decode_fail_before_any_child(tmp_path, cleanup):
    run = script(tmp_path, UNGUARDED_MAIN_DECODE, 2)
    cleanup(run)
    code, out, err = run.run()
    assert code != 0 and "finished" not in out
    raised = [line for line in err.splitlines() if line.startswith("RuntimeError: ")]
    assert len(raised) == 1, err
    line = raised[0]
    assert line.startswith("RuntimeError: asyncload: processes=2 cannot start child processes: decode= needs "
                           "make_item from " + str(run.path))
    assert 'under `if __name__ == "__main__":`' in line
    assert run.marked("top") == {run.process.pid}, "no child ran the script's top level"
    assert run.marked("decoded") == set()
    assert run.left_alive() == []


@pytest.mark.parametrize("processes", [None, 2])
def test_a_top_level_assignment_that_calls_something_is_work_not_a_definition(tmp_path, cleanup, processes):
    """``ds = download()`` outside the guard would run again in every child that imports the script:
    the default stays in this process (and says so), an explicit ``processes=2`` fails first."""
    run = script(tmp_path, ASSIGNED_WORK, processes)
    cleanup(run)
    code, out, err = run.run()
    assert run.marked("top") == {run.process.pid}, "the script's top level ran in one process only"
    why = 'its top level runs `_mark = open(os.path.join(' 
    if processes is None:
        assert code == 0 and "finished" in out, err
        assert run.marked("decoded") == {run.process.pid}, "it stayed in this process"
        warned = [line for line in err.splitlines() if "RuntimeWarning: asyncload: processes=None stays" in line]
        assert len(warned) == 1 and why in warned[0] and "at line 10" in warned[0], err
    else:
        assert code != 0 and "finished" not in out
        raised = [line for line in err.splitlines() if line.startswith("RuntimeError: ")]
        assert len(raised) == 1 and why in raised[0] and "at line 10" in raised[0], err
        assert run.marked("decoded") == set()
    assert run.left_alive() == []


@pytest.mark.parametrize("processes", [None, 2])
def test_a_guarded_script_that_defines_the_decode_still_gets_children(tmp_path, cleanup, processes):
    run = script(tmp_path, GUARDED_MAIN_DECODE, processes)
    cleanup(run)
    code, out, err = run.run()
    assert code == 0, err
    assert "finished" in out
    assert run.marked("top") == {run.process.pid}, "what is under the guard ran once"
    decoders = run.marked("decoded")
    assert len(decoders - {run.process.pid}) == 2, "two children imported the script and decoded"
    assert run.left_alive() == []


def test_a_script_whose_top_level_only_defines_things_is_not_a_hazard(tmp_path, monkeypatch):
    """The parts of the check, without a process: definitions, the guard (either way round),
    ``if``/``try`` blocks of definitions are fine; a loop, a call for its own sake are not."""
    import sys
    import types

    from asyncload.procs.script import rerun_hazard

    def hazard(text: str) -> str | None:
        path = tmp_path / f"s{abs(hash(text))}.py"
        path.write_text(text)
        module = types.ModuleType("__main__")
        module.__file__ = str(path)
        monkeypatch.setitem(sys.modules, "__main__", module)
        return rerun_hazard()

    assert hazard('"""doc"""\nimport os\nfrom x import y\nA = os.getcwd()\nB: int = 1\n'
                  'def f():\n    pass\nclass C:\n    pass\ntry:\n    import z\nexcept ImportError:\n    z = None\n'
                  'if "__main__" == __name__:\n    f()\n') is None
    assert hazard("import os\nfor i in range(3):\n    pass\n") == "its top level runs `for i in range(3): ...` at line 2"
    assert hazard("def main():\n    pass\nmain()\n") == "its top level runs `main()` at line 3"
    assert hazard("import logging, os, re, typing, collections\nlog = logging.getLogger(__name__)\n"
                  "T = typing.TypeVar('T')\nP = collections.namedtuple('P', 'x y')\nR = re.compile('a+')\n"
                  "HERE = os.path.dirname(os.path.abspath(__file__))\nN = int(os.environ.get('N', '4'))\n"
                  "f = lambda x: print(x)\nX: int = len  # no call\n") is None
    assert hazard("import torch\nds = download()\n") == "its top level runs `ds = download()` at line 2"
    assert hazard("model = Net().cuda()\n") == "its top level runs `model = Net().cuda()` at line 1"
    assert hazard("n: int = count()\n") == "its top level runs `n: int = count()` at line 1"
    assert hazard("n = 0\nn += step()\n") == "its top level runs `n += step()` at line 2"
    assert hazard("try:\n    xs = [load(i) for i in range(3)]\nexcept OSError:\n    xs = []\n") == \
        "its top level runs `xs = [load(i) for i in range(3)]` at line 2"
    assert hazard("import sys\nif sys.argv:\n    print('x')\n") == "its top level runs `print('x')` at line 3"
