"""The router stands without torch (a router machine in front of the cluster needs no GPU
libraries): importing it, its disaggregated dispatcher, the gRPC servicer, the OpenAI-compatible
HTTP front and the shared request vocabulary loads no torch. Run in a fresh interpreter: this test process has torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["tandem.router", "tandem.router.disagg",
                                    "tandem.router.server", "tandem.router.servicer",
                                    "tandem.messages", "tandem.tokenizer", "tandem.trace",
                                    "tandem.otel", "tandem.http_api", "tandem.http_api.app",
                                    "tandem.http_api.server"])
def test_importing_it_loads_no_torch(module):
    code = (f"import sys, {module}; loaded = [m for m in sys.modules if m.split('.')[0] == 'torch'];"
            " assert not loaded, loaded[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_engine_face_still_offers_every_public_name():
    import tandem.engine as engine

    for name in engine.__all__:
        assert getattr(engine, name) is not None
    from tandem.engine.sampling import SamplingParams as S1
    from tandem.engine import SamplingParams as S2
    from tandem.engine.request import FinishReason as F1
    from tandem.engine import FinishReason as F2

    assert S1 is S2 and F1 is F2
