"""The one-device ``moonep`` stub (``moonep/`` here): this folder on ``sys.path`` makes ``import moonep`` find it."""

import os
import sys

PATH = os.path.dirname(os.path.abspath(__file__))


def use(monkeypatch, device=None):
    """Make ``import moonep`` find the stub, with its Buffers on ``device``, until the test ends."""
    monkeypatch.syspath_prepend(PATH)
    monkeypatch.delitem(sys.modules, "moonep", raising=False)
    import moonep

    monkeypatch.setitem(sys.modules, "moonep", moonep)  # so that teardown removes it again
    monkeypatch.setattr(moonep, "DEVICE", device)
    return moonep
