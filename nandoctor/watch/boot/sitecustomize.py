"""Run by every Python process `nandoctor watch` starts: this folder is put first on
PYTHONPATH, and Python imports `sitecustomize` at startup. It hands over to
`nandoctor.watch.bootstrap` when the watch's environment variable is set, then runs the
`sitecustomize` this one hides, if the environment has one, so nothing of the user's is
lost. A failure here prints one line and never stops the user's program.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _watch() -> None:
    if not os.environ.get("NANDOCTOR_WATCH"):
        return
    try:
        from nandoctor.watch import bootstrap

        bootstrap.install()
    except Exception as e:  # e.g. this Python cannot import nandoctor
        sys.stderr.write(f"nandoctor watch: not attached: {type(e).__name__}: {e}\n")


def _run_hidden_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # theirs from now on; ours has done its work
    spec.loader.exec_module(module)


_watch()
_run_hidden_sitecustomize()
