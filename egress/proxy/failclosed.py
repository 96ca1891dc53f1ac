"""The one wrapper of every guard hook: a refusal is carried out, a guard that breaks refuses.

mitmproxy runs each addon hook inside ``safecall``: an exception is logged as an
"Addon error" and the flow goes on as if the hook had not been there. Measured: a
Host port of 5000 digits made the policy guard's int() raise ValueError, and the
request was forwarded. Every hook of a guard is therefore decorated::

    from egress.proxy.failclosed import guard
    from egress.proxy.refusal import Refused

    class MyGuard:
        def __init__(self, engine): self.engine = engine

        @guard
        async def requestheaders(self, flow):
            if ...:
                raise Refused(decision)            # Stage.HEAD: the refusal is the answer

and what the hook raises (or the awaitable it returns, when it hands mitmproxy one) is caught:

* :class:`egress.proxy.refusal.Refused` first: :func:`egress.proxy.refusal.refuse` for the
  hook's data, at the refusal's stage (one event; the answer, a kill, a close or a 1008);
* any other ``Exception`` second (cancellation passes), which ends what the hook was
  looking at, fail closed:

  * an HTTP flow: refused with reason ``guard-error`` (one event; the refusal response while
    the request can still be answered, else killed);
  * a server connection (``server_connect`` ...): its ``error`` is set, so it is never
    opened, and the client connection is closed;
  * a client connection (``client_connected``): refused (``client.error``);
  * ``next_layer``: the connection gets a layer that closes it;
  * anything with a ``context`` (TLS hooks): its client connection is closed.

  The exception is logged once, with the hook's name, its type and its message passed
  through the credential redactor. A refusal that itself fails is such an exception.

The addon needs an ``engine`` attribute to refuse and record (without one a flow is still
killed). tests/proxy/test_guard_hooks.py checks that every hook of every addon in
egress/proxy/addons carries this wrapper.
"""

from __future__ import annotations

import functools
import inspect
import logging

from mitmproxy import connection, http
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from egress.policy.matcher import Decision
from egress.proxy import refusal
from egress.proxy.flowstate import flow_state
from egress.proxy.refusal import Refused, Stage

logger = logging.getLogger("egress")

GUARD_ERROR = "guard-error"


def guard(hook):
    """Decorate an addon hook (sync or async) so that a :class:`Refused` it raises is carried out
    and any other exception refuses instead of passing."""
    if inspect.iscoroutinefunction(hook):
        @functools.wraps(hook)
        async def guarded(self, data):
            try:
                try:
                    return await hook(self, data)
                except Refused as refused:
                    _carry_out(self, data, refused)
            except Exception as e:
                fail(self, hook.__qualname__, data, e)
    else:
        @functools.wraps(hook)
        def guarded(self, data):
            try:
                try:
                    result = hook(self, data)
                except Refused as refused:
                    _carry_out(self, data, refused)
                    return None
            except Exception as e:
                fail(self, hook.__qualname__, data, e)
                return None
            if result is not None and inspect.isawaitable(result):
                # work handed to mitmproxy to await (a large body scanned between looks): what it
                # raises there would be logged as an "Addon error" and let through
                return _awaited(self, hook.__qualname__, data, result)
            return result
    guarded.guarded = True
    return guarded


async def _awaited(addon, where: str, data, awaitable):
    try:
        try:
            return await awaitable
        except Refused as refused:
            _carry_out(addon, data, refused)
    except Exception as e:
        fail(addon, where, data, e)


def _carry_out(addon, data, refused: Refused) -> None:
    engine = getattr(addon, "engine", None)
    if engine is None:
        raise TypeError(f"{type(addon).__name__} refused without an engine to refuse with")
    refusal.refuse(engine, data, refused.decision, refused.stage, status=refused.status, method=refused.method)


def fail(addon, where: str, data, error: Exception) -> None:
    """Refuse or close what ``data`` (a hook's argument) stands for, after ``error`` in ``where``."""
    engine = getattr(addon, "engine", None)
    clean = engine.recorder.clean if engine is not None else (lambda text: text)
    try:
        what = _refuse(engine, where, data, error)
    except Exception as second:  # refusing failed too: close whatever can be closed
        what = f"refusing failed too ({type(second).__name__}); closed"
        _close_anything(data)
    try:
        logger.error(f"{where} failed ({type(error).__name__}: {clean(str(error))[:200]}); {what}")
    except Exception:  # a broken log handler must not undo the refusal
        pass


def _refuse(engine, where: str, data, error: Exception) -> str:
    detail = f"{where}: {type(error).__name__}"
    if isinstance(data, http.HTTPFlow):
        if engine is None:
            refusal.close(data.client_conn, data.server_conn) if not data.killable else data.kill()
            return "the flow was killed"
        request = data.request
        stage = Stage.HEAD if data.response is None else Stage.RESPONSE
        refusal.refuse(engine, data, Decision(request.host or "unknown", request.port, False, GUARD_ERROR,
                                              detail=detail), stage, after_allow=False)
        if data.response is not None and not flow_state(data).refused and data.killable:
            data.kill()  # already reported (say, as allowed): the event stands, the flow still stops
            return "the flow was killed"
        return "the request was refused"
    if isinstance(data, ServerConnectionHookData):
        data.server.error = f"EGRESS_BLOCKED: {detail}"
        refusal.close(data.client, data.server)
        return "the connection was closed"
    if isinstance(data, connection.Client):
        data.error = f"EGRESS_BLOCKED: {detail}"
        return "the client connection was refused"
    if isinstance(data, layer.NextLayer):
        data.layer = CloseClient(data.context)
        return "the client connection was closed"
    context = getattr(data, "context", None)
    if context is not None:
        refusal.close(context.client)
        return "the client connection was closed"
    return "nothing to refuse"


def _close_anything(data) -> None:
    try:
        if isinstance(data, http.HTTPFlow):
            refusal.close(data.client_conn, data.server_conn)
        elif isinstance(data, ServerConnectionHookData):
            refusal.close(data.client, data.server)
        elif isinstance(data, connection.Client):
            data.error = "EGRESS_BLOCKED"
        elif getattr(data, "context", None) is not None:
            refusal.close(data.context.client)
    except Exception:  # the last resort failed: mitmproxy logs it
        logger.exception("egress could not close a connection after a guard failed")


class CloseClient(layer.Layer):
    """A layer that closes the client connection at once and ignores everything else."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)
