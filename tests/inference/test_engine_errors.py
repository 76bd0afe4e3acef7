"""An engine's error event becomes the client's error of the right class."""

from __future__ import annotations

import pytest

from engine import protocol
from inference.errors import EngineFailed, InvalidRequest, NoEngineAvailable
from inference.responses import raise_for_final as _raise_for_final


def _error(code: str, message: str = "") -> protocol.Event:
    return protocol.Event(seq=3, type=protocol.EV_ERROR, data={"code": code, "message": message})


def test_a_request_the_engine_refuses_as_invalid_is_the_clients_400():
    with pytest.raises(InvalidRequest) as refused:
        _raise_for_final(_error(protocol.ERROR_INVALID_REQUEST,
                                "adapter abc cannot be loaded: rank 80 > 64"))
    assert refused.value.status == 400 and refused.value.code == "invalid_request"
    assert "rank 80 > 64" in refused.value.message


@pytest.mark.parametrize("code", [protocol.ERROR_ENGINE, protocol.ERROR_ENGINE_LOST,
                                  "a-code-from-a-newer-engine"])
def test_the_engines_own_failures_are_502(code):
    with pytest.raises(EngineFailed) as failed:
        _raise_for_final(_error(code, "CUDA out of memory at layer 3"))
    assert failed.value.status == 502
    assert "CUDA" not in failed.value.message  # the engine's internals stay inside


def test_an_engine_stopped_before_it_finished_is_a_503_to_retry():
    with pytest.raises(NoEngineAvailable) as stopped:
        _raise_for_final(_error(protocol.ERROR_ENGINE_SHUTDOWN, "SIGTERM"))
    assert stopped.value.status == 503 and stopped.value.code == "engine_unavailable"
    assert stopped.value.headers["retry-after"] == "1"
    assert "SIGTERM" not in stopped.value.message
