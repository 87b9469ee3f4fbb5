"""Imported at start-up by a test server's interpreter when this folder is on PYTHONPATH: every
onnxruntime step then takes at least KVFORGE_TEST_STEP_S seconds more, as a model larger than the
tiny one's would, so that a long request is still running when a test looks at it (the tiny
model generates 240 tokens in about 25 ms on an idle machine)."""

import os
import time

_DELAY = float(os.environ.get("KVFORGE_TEST_STEP_S", "0"))

if _DELAY > 0:
    from kvforge.runners.session import OrtSession

    _run = OrtSession.run

    def _slow_run(self: OrtSession, feeds: dict) -> dict:  # type: ignore[type-arg]
        time.sleep(_DELAY)
        return _run(self, feeds)

    OrtSession.run = _slow_run  # type: ignore[method-assign]
