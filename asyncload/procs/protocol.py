"""The messages between the parent and its child processes, and how values cross the pipe.

The driver speaks to a child's pipeline with ``pipeline/messages.py``'s messages (``Start``, ``Fill``,
``Probe``, ``Stop``; ``Done``, ``Probed``, ``Stopped``), as it does to the pipeline in its own
process; this module adds what only processes need: shared segments (``Map``, ``Unmap``), the
tuner's ``Limits``, ``Close``, a child that could not start (``Broken``), and pickling.
Samples never cross: a child writes them into the shared segment's rows.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

from ..batch.layout import SampleLayout
from ..errors import SampleError, TooManyFailures, describe
from ..pipeline.messages import Done, Failed, Fill, Poisoned, Probe, Probed, Start, Stop, Stopped  # noqa: F401 (the protocol's own)
from ..redact import unpicklable

# A child that finds itself created while it imports the user's script again (a script with
# no ``if __name__ == "__main__":`` guard) exits with this code; the parent then says why.
MAIN_GUARD_EXIT = 86


# ----- parent -> child -----


@dataclass
class Map:
    """A new shared segment of ``capacity`` rows of ``layout``; its descriptor follows."""

    segment: int
    layout: SampleLayout
    capacity: int


@dataclass
class Unmap:
    """Segments the parent dropped: no fill will name them again."""

    segments: list[int]


@dataclass
class Limits:
    """The tuner's new per-process settings (None: unchanged)."""

    num_threads: int | None
    io_concurrency: int | None


@dataclass
class Close:
    pass


# ----- child -> parent -----


@dataclass
class Broken:
    """The child could not build its pipeline, or cannot go on (``what``; ``error`` says why):
    the parent raises; the child waits for ``Close`` or its end."""

    error: BaseException
    figures: dict[str, Any] | None = field(default=None)
    trace: Any = None
    what: str = "a loader process could not build its pipeline"


@dataclass
class Ready:
    """The child has built its pipeline: a loader that starts children while it runs in its own
    process (``processes=None``) switches to them only then, so that its loop never waits for
    their start."""

    figures: dict[str, Any] | None = field(default=None)
    trace: Any = None


# ----- values across the pipe -----


def pickled_arguments(arguments: dict[str, Any]) -> dict[str, bytes]:
    """Each argument pickled on its own, so that the one that cannot be is named."""
    payload = {}
    for name, value in arguments.items():
        try:
            payload[name] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"processes= (and isolate=True) run the pipeline in fresh processes, so "
                f"{name}= must pickle, and {unpicklable(value)} does not ({describe(error)}). Use a function "
                f"or class defined at the top level of a module, not a lambda, a nested function or a local class"
            ) from error
    return payload


def unpickle(name: str, data: bytes) -> Any:
    """In the child: one argument, or an error that says why a fresh process cannot find it."""
    try:
        return pickle.loads(data)
    except Exception as error:
        raise RuntimeError(
            f"the loader's process could not unpickle {name}= ({type(error).__name__}: {error}); "
            f"a fresh process finds functions and classes by module and name, so those defined in an "
            f"interactive session's __main__ are not found: define them in a module"
        ) from error


def portable(error: BaseException) -> BaseException:
    """``error`` as it can cross the pipe: itself if it pickles, else stand-ins with its text.
    The child's traceback goes along as a note on the underlying error."""
    cause = error.cause if isinstance(error, SampleError) and not isinstance(error, TooManyFailures) else error
    if hasattr(cause, "add_note") and cause.__traceback__ is not None:
        text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        cause.add_note("in the loader's process:\n" + text.rstrip())
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        pass
    if isinstance(error, SampleError):
        return SampleError(_portable_item(error.item), error.stage, _stand_in(error.cause))
    return _stand_in(error)


def _portable_item(item: Any) -> Any:
    try:
        pickle.dumps(item)
        return item
    except Exception:
        return repr(item)


def _stand_in(error: BaseException) -> RuntimeError:
    stand_in = RuntimeError(f"{type(error).__name__}: {error}")
    for note in getattr(error, "__notes__", []):
        stand_in.add_note(note)
    return stand_in
