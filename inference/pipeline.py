"""The one path a request takes to the engine, whatever it came in on.

authenticate → (the entry point's trace) → precheck → prepare → admit → dispatch, then the
entry point relays ``responses.stream_chunks`` or ``responses.collect``, whose own cleanup
(``service.close``) settles the admission. The JSON view, SSE, the websocket and the
batch runner (inference/batch_runner.py) call :func:`start`. A step that refuses gives
back what the steps before it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from core.errors import ApiError, InvalidRequest
from core.metrics import ADMISSION_SECONDS
from inference import admission as quota
from inference import service, telemetry
from inference.dispatch import Dispatch
from inference.relay import Subscription, event_hub
from inference.requestlog import Trace
from inference.routing import SESSION_MAX


@dataclass(slots=True)
class Started:
    """A request admitted and queued for an engine."""

    prepared: service.Prepared
    admission: quota.Admission
    dispatch: Dispatch

    @property
    def headers(self) -> dict[str, str]:
        """What every answer to it carries: its id and the caller's rate-limit state."""
        return {"x-request-id": self.prepared.response_id, **self.admission.headers()}


async def start(trace: Trace, *, before_admit: Callable[[], None] | None = None,
                batch_line: str | None = None, session: str | None = None) -> Started:
    """Admits ``trace.body`` for ``trace.principal`` and queues it; fills in the trace.

    ``before_admit`` runs once the request is known to be valid, before it takes any quota:
    an entry point's own limit (the websocket's requests per socket) refuses there, so an
    invalid request never counts against it. ``batch_line``: a batch line's ledger key (the
    batch runner's requests). ``session``: the conversation's hint for placement (the
    ``x-session-id`` header of the request, or of the websocket's handshake;
    inference/routing.py); empty is none."""
    began = time.perf_counter()
    if session is not None and len(session) > SESSION_MAX:
        raise InvalidRequest(f"the x-session-id header is longer than {SESSION_MAX} "
                             "characters", param="x-session-id", code="invalid_value")
    # The process's own limit first (relay.py): a request past it costs nothing.
    subscription = event_hub().subscribe()
    try:
        started = await _admitted(trace, subscription, before_admit, batch_line, session)
    except BaseException:
        subscription.close()
        raise
    trace.dispatch = started.dispatch
    ADMISSION_SECONDS.observe(time.perf_counter() - began)
    telemetry.phase(trace.span, "admission", began)
    return started


async def _admitted(trace: Trace, subscription: Subscription,
                    before_admit: Callable[[], None] | None,
                    batch_line: str | None, session: str | None) -> Started:
    # A refused caller costs no tokenizing.
    limits = await service.precheck(trace.principal, trace.body)
    try:
        # Tokenizing a long prompt is CPU work: keep it off the event loop.
        prepared = await sync_to_async(service.prepare, thread_sensitive=False)(
            principal=trace.principal, kind=trace.kind, body=trace.body,
            batch_line=batch_line)
    except ApiError as exc:
        # The key is known: its refusal says where it stands, as every answer to it does.
        exc.headers = {**limits.headers(), **exc.headers}
        raise
    trace.prepared = prepared
    prepared.session = session or None
    prepared.engine_request.traceparent = telemetry.traceparent(trace.span)
    if before_admit is not None:
        before_admit()
    admission = await service.admit(prepared)
    try:
        dispatch = await service.open_dispatch(prepared, subscription)
    except BaseException as exc:
        await service.release(prepared, admission, None)
        if isinstance(exc, ApiError):
            exc.headers = {"x-request-id": prepared.response_id, **admission.headers(),
                           **exc.headers}
        raise
    return Started(prepared, admission, dispatch)
