# ruff: noqa: UP031, UP006, UP035, UP045
"""chaosgpu's fault injector, loaded at interpreter start through PYTHONPATH.

A job started with this folder on PYTHONPATH and CHAOSGPU_INJECT_DIR set is *armed*: the
injector (chaosgpu_injector.py beside this file) starts one daemon thread that waits for a
trigger naming this very process (see chaosgpu_injector). Without CHAOSGPU_INJECT_DIR nothing
happens: no thread, no file, no import beyond `os`. Either way the next `sitecustomize` on
sys.path (a distribution's or the job's own) still runs, so shadowing it changes nothing.
"""

import os as _os

if _os.environ.get("CHAOSGPU_INJECT_DIR"):
    try:
        import chaosgpu_injector as _chaosgpu_injector

        _chaosgpu_injector.arm()
    except Exception as _error:  # the injector must never break the job it is loaded into
        import sys as _sys

        _sys.stderr.write("chaosgpu injector: not armed: %s\n" % (_error,))


def _chain_next_sitecustomize():
    import importlib.machinery
    import importlib.util
    import sys

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in sys.path if _os.path.abspath(p or _os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == _os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain_next_sitecustomize()
