"""One inference request's life, whatever it came in on: :class:`Run`.

An entry point (the JSON view, SSE, the websocket, a batch line, and each protocol to come)
authenticates its caller, opens a ``Run`` and only translates wire formats:

    async with pipeline.Run(principal, kind, transport="http", span=span) as run:
        run.body = body
        started = await run.start(session=...)
        return await run.collect()        # or: relay run.stream(), whose end is the run's

``start`` takes, in order, a place in the process's event hub (event_hub.py), the caller's quotas
(precheck → prepare → admit) and the engine's queue (dispatch); a step that refuses
raises, and what the steps before it took is given back when the run ends. However the
run ends (answered, refused at any step, cancelled, its client gone, its engine lost), it
ends in one place, once (:meth:`Run.end`): the engine's work stopped if it still runs
and its final usage awaited, its event hub place closed, the quota settled with the usage
billing gets, then the request logged with its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from core.errors import ApiError, InvalidRequest
from core.metrics import ADMISSION_SECONDS
from core.redis import async_client
from inference import admission as quota
from inference import embeddings, prompt_cache, responses, resumable, service, telemetry, tiers
from inference.dispatch import FINAL_WAIT_S, Dispatch
from inference.event_hub import Replay, Subscription, event_hub
from inference.requestlog import Trace
from inference.routing import SESSION_MAX
from tenants.facade import Principal

log = logging.getLogger(__name__)


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


class Run:
    """One request from its authenticated caller to its last release.

    Holds what the request takes, in this order: ``subscription`` (its place in the event
    hub), ``admission``, ``dispatch``; and its ``trace`` (the request log's view,
    requestlog.py). ``client_gone``: the exceptions by which the entry point learns its
    client left (a 499, not a failure). As an async context manager it records how the
    block ended and ends the run, unless the block handed the run to its stream
    (:meth:`stream`), whose end then ends it.
    """

    def __init__(self, principal: Principal, kind: service.Kind, *, transport: str,
                 span: Any = None, client_gone: tuple[type[BaseException], ...] = (),
                 endpoint: str | None = None) -> None:
        self.trace = Trace(principal, kind, transport=transport, span=span,
                           endpoint=endpoint)
        self.client_gone = client_gone
        # Whether its end gives back what it holds and logs it: not for a resumable
        # request's replay in another web process (inference/resumable.py), until it owns it.
        self.owning = True
        self.subscription: Subscription | Replay | None = None
        self.admission: quota.Admission | None = None
        self.dispatch: Dispatch | None = None
        self._streaming = False
        self._ending: asyncio.Future | None = None

    @property
    def body(self) -> Any:
        return self.trace.body

    @body.setter
    def body(self, value: Any) -> None:
        self.trace.body = value

    @property
    def prepared(self) -> service.Prepared | None:
        return self.trace.prepared

    # --- the way in ------------------------------------------------------------------------

    async def start(self, *, before_admit: Callable[[], None] | None = None,
                    batch_line: str | None = None, session: str | None = None,
                    client_timeout: str | None = None) -> Started:
        """Admits ``body`` for the caller and queues it.

        ``before_admit`` runs once the request is known to be valid, before it takes any
        quota: an entry point's own limit (the websocket's requests per socket) refuses
        there, so an invalid request never counts against it. ``batch_line``: a batch
        line's ledger key (the batch runner's requests). ``session``: the conversation's
        hint for placement (the ``x-session-id`` header of the request, or of the
        websocket's handshake; inference/routing.py); empty is none. ``client_timeout``:
        the seconds the client waits for an answer, as it said (tiers.CLIENT_TIMEOUT_HEADER):
        how long a flex request may wait for an engine."""
        began = time.perf_counter()
        resumable.ensure_ticker()  # this process takes over resumable requests others drop
        if session is not None and len(session) > SESSION_MAX:
            raise InvalidRequest(f"the x-session-id header is longer than {SESSION_MAX} "
                                 "characters", param="x-session-id", code="invalid_value")
        # The process's own limit first (event_hub.py): a request past it costs nothing.
        self.subscription = event_hub().subscribe()
        # A refused caller costs no tokenizing.
        limits = await service.precheck(self.trace.principal, self.body)
        try:
            # Tokenizing a long prompt is CPU work: keep it off the event loop.
            prepare = embeddings.prepare if self.trace.kind == "embedding" \
                else service.prepare
            prepared = await sync_to_async(prepare, thread_sensitive=False)(
                principal=self.trace.principal, kind=self.trace.kind, body=self.body,
                batch_line=batch_line, endpoint=self.trace.endpoint)
        except ApiError as exc:
            # The key is known: its refusal says where it stands, as every answer to it does.
            exc.headers = {**limits.headers(), **exc.headers}
            raise
        self.trace.prepared = prepared
        prepared.session = session or prompt_cache.key_of(self.body)
        prepared.engine_request.traceparent = telemetry.traceparent(self.trace.span)
        request = prepared.engine_request
        request.queue_deadline = tiers.queue_deadline(request.service_tier, client_timeout,
                                                      request.deadline or time.time())
        if before_admit is not None:
            before_admit()
        # NOTE: shielded, here and for the dispatch: a cancel landing while the admission
        # script or the XADD is on its way must still learn what they took, so that the
        # run's end gives it back (the quota now, not when its lease runs out; the
        # engine's queue entry at once, not after the engine ran it for nobody).
        admitting = asyncio.ensure_future(service.admit(prepared))
        try:
            self.admission = await asyncio.shield(admitting)
        except asyncio.CancelledError:
            if await _succeeded(admitting):
                self.admission = admitting.result()
            raise
        dispatch = Dispatch(async_client(), prepared.engine_request,
                            deadline=prepared.engine_request.deadline or time.time(),
                            subscription=self.subscription)
        submitting = asyncio.ensure_future(dispatch.submit(prepared.session))
        try:
            await asyncio.shield(submitting)
        except asyncio.CancelledError:
            if await _succeeded(submitting):
                self.dispatch = dispatch
            raise
        except ApiError as exc:
            exc.headers = {"x-request-id": prepared.response_id, **self.admission.headers(),
                           **exc.headers}
            raise
        self.dispatch = dispatch
        self.trace.dispatch = self.dispatch
        ADMISSION_SECONDS.observe(time.perf_counter() - began)
        telemetry.phase(self.trace.span, "admission", began)
        return Started(prepared, self.admission, self.dispatch)

    async def replay(self, *, request_id: str, created: int, deadline: float,
                     admission: quota.Admission | None) -> None:
        """The run of a resumable request started before, by this or another web process,
        read again from its first event (inference/resumable.py): it owns the request
        (gives back ``admission`` and logs it at its end) only when given the hold."""
        self.trace.prepared = await sync_to_async(service.prepare, thread_sensitive=False)(
            principal=self.trace.principal, kind=self.trace.kind, body=self.body,
            endpoint=self.trace.endpoint, again=(request_id, created, deadline))
        self.subscription = Replay()
        self.dispatch = Dispatch(async_client(), self.trace.prepared.engine_request,
                                 deadline=deadline, subscription=self.subscription)
        self.dispatch.keep_events_s = settings.ATRIUM_RESUME_RETENTION_S
        self.trace.dispatch = self.dispatch
        self.admission = admission
        self.owning = admission is not None

    def own(self, admission: quota.Admission) -> None:
        """A replay takes the request over: its end now settles ``admission`` and logs."""
        self.admission, self.owning = admission, True

    def disown(self) -> None:
        """Another process owns the request now: this run's end only stops reading."""
        self.owning = False

    # --- the way out -----------------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        """The whole response object (responses.collect, or embeddings.collect); the run
        ends before it returns."""
        async with self._ending_with_outcome():
            collect = embeddings.collect if self.trace.kind == "embedding" \
                else responses.collect
            result = await collect(self.trace.prepared, self._started_dispatch())
            self.trace.completed(result)
            return result

    def stream(self) -> AsyncIterator[dict[str, Any] | None]:
        """The response's chunks (responses.stream_chunks; None: idle), each recorded for
        the log. The run is the stream's from here: it ends when the stream does, however
        it does (closed unread too: call :meth:`abandon` if it is never iterated)."""
        self._streaming = True
        return self._stream()

    async def _stream(self) -> AsyncIterator[dict[str, Any] | None]:
        async with self._ending_with_outcome():
            # NOTE: closed here, not left to the garbage collector: the engine's work is
            # stopped and its usage read before the run ends.
            async with contextlib.aclosing(responses.stream_chunks(
                    self.trace.prepared, self._started_dispatch())) as chunks:
                async for chunk in chunks:
                    self.trace.record_chunk(chunk)
                    yield chunk
            self.trace.answered()

    async def abandon(self) -> None:
        """A stream that will never be read (its client left before the first byte)."""
        self.trace.cancel()
        await self.end()

    async def end(self) -> None:
        """Gives back what the request holds and logs it: once, in one place, whichever way
        it ended, shielded so that a second cancellation (a socket closing after a cancel)
        cannot cut it short."""
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._release())
            self._ending.add_done_callback(_log_failed_release)
        try:
            await asyncio.shield(self._ending)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged by _log_failed_release
            # NOTE: a release that failed (Redis away: the engine stops on its own, the
            # quota is settled in the background) must not replace how the request ended.
            pass

    async def _release(self) -> None:
        dispatch = self.dispatch
        if not self.owning:
            if self.subscription is not None:
                self.subscription.close()
            return
        try:
            if dispatch is not None and not dispatch.final_read:
                await dispatch.cancel()
                await dispatch.wait_final(FINAL_WAIT_S)
        finally:
            try:
                if self.subscription is not None:
                    self.subscription.close()
                if self.admission is not None:
                    await service.release(self.trace.prepared, self.admission, dispatch)
            finally:
                # Last: the log, its metrics and its span carry the engine's usage.
                self.trace.submit()

    # --- how it ended ----------------------------------------------------------------------

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: Any) -> None:
        if exc is not None:
            self._record(exc)
        # NOTE: a block that raised after stream() never handed the stream on.
        if exc is not None or not self._streaming:
            await self.end()

    @contextlib.asynccontextmanager
    async def _ending_with_outcome(self) -> AsyncIterator[None]:
        try:
            yield
        except BaseException as exc:
            self._record(exc)
            raise
        finally:
            await self.end()

    def _record(self, exc: BaseException) -> None:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit, *self.client_gone)):
            self.trace.cancel()
        else:
            self.trace.fail(exc)

    def _started_dispatch(self) -> Dispatch:
        if self.dispatch is None:
            raise RuntimeError("the run was not started")
        return self.dispatch


async def _succeeded(task: asyncio.Future) -> bool:
    """Whether ``task``, a step of ``start`` cancelled while on its way, did what it was
    sent to do (then the run's end gives back what it took)."""
    try:
        await task
    except Exception:  # noqa: BLE001 - it took nothing
        return False
    return True


def _log_failed_release(ending: asyncio.Future) -> None:
    # NOTE: read here too: its awaiter may have been cancelled and never read it.
    if ending.cancelled() or (error := ending.exception()) is None:
        return
    if isinstance(error, redis.RedisError):  # an outage: the engine stops on its own
        log.warning("releasing a request failed: Redis is unreachable (%s)", error)
    else:
        log.warning("releasing a request failed", exc_info=error)
