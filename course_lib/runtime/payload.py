"""A function and its arguments pickled by value for the ranks (lesson 00): the ``payload.pkl`` that `launch.run`
writes into a run folder and `course_lib.runtime._worker` loads in every rank.

The ranks import installed packages and course_lib; everything else (a function defined in a notebook cell, a test
file, a learner's module beside a notebook) travels by value with cloudpickle, its code included. Each code object
keeps the name of the file it came from, so that a rank's traceback points at the learner's own file and line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence


def _importable_by_workers(module) -> bool:
    """Workers import installed packages and course_lib; anything else (a test file, a learner's module
    beside a notebook, ``__main__``) is sent by value."""
    path = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or not path:
        return module.__name__ != "__main__"
    path = os.path.realpath(path)
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    roots.add(str(Path(__file__).resolve().parents[1]))  # course_lib itself (this file is course_lib/runtime/...)
    return any(path.startswith(root + os.sep) for root in roots)


def _code_with_its_file(rebuild: Callable, args: tuple, filename: str):
    """Rebuilds a code object shipped by `_dumps` under the file it came from."""
    return rebuild(*args).replace(co_filename=filename)


def _dumps(obj: Any) -> bytes:
    """cloudpickle.dumps, keeping each function's file name.

    cloudpickle 3.1.3 ships every code object as '<dynamic-code>' (for byte-identical payloads), which would
    turn a rank's traceback and the NCCL rules' "made at FILE:LINE" into '<dynamic-code>:92'. Here each code
    object carries its file name and gets it back on the rank; line numbers were always kept."""
    import io
    import types
    from collections import ChainMap

    import cloudpickle
    from cloudpickle import cloudpickle as impl

    def reduce_code(code: types.CodeType):
        rebuild, args = impl._code_reduce(code)
        return _code_with_its_file, (rebuild, args, code.co_filename)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def pickle_payload(fn: Callable, args: Sequence, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` as the bytes of ``payload.pkl``; ``fn``'s module travels by value unless the ranks can
    import it. Whatever cannot be pickled (a lock, a file, a socket, a process group) raises as pickle raises it:
    the launcher turns that into its own error (`launch.LaunchError`)."""
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and not _importable_by_workers(module):
        cloudpickle.register_pickle_by_value(module)  # e.g. a test file or a learner's own .py next to a notebook
    return _dumps((fn, tuple(args), dict(kwargs)))
