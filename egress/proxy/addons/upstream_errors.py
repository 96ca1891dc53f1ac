"""Upstream failures, named: what failed, for the client, the audit log and the person.

mitmproxy answers an upstream it could not reach with an HTML 502 page of its own.
Inside a tunnel that page came after the CONNECT's 200, so ``curl https://...`` printed
it and exited 0; `egress run` said nothing; and every cause (refused, unreachable, an
untrusted certificate) was recorded as ``connect-failed``. Here each failure of an
allowed request is classified from the hook that saw it:

* ``server_connect_error``: the connection could not be opened -> ``connect-failed``;
* ``tls_failed_server``: the TLS handshake failed -> ``upstream-certificate`` when the
  certificate did not verify (OpenSSL's reason in the detail and, when its issuer is the
  unknown part, the fix: ``--upstream-ca``), else ``tls-failed``;
* a timeout UpstreamTimeout already named -> ``upstream-timeout``;
* any other failure while the client is still there (the server closed the connection or
  sent something mitmproxy refused) -> ``connect-failed``, mitmproxy's message as detail.

One destination is known to fail before it is dialled: this proxy's own listening address
(a name, allowed and ``allow_private``, that resolves to the loopback address and port the
proxy listens on). Dialled, it would come back here, again and again. It is not an upstream
that failed but a destination egress will not serve: it is refused (``private-address``, 403,
the address in the detail) at the CONNECT or the request head, by the address check
(egress.proxy.connect.own_address), before anything is dialled. A dial a guard still refuses at ``server_connect``
(AddressGuard, Stage.SERVER_CONNECT) is no upstream failure either: ``server_connect_error``
leaves it, and the flow's ``error`` hook refuses the flow for it (egress.proxy.refusal.
take_dial_refusal): the client gets the 403 refusal, not a ``connect-failed`` 502.

A flow that ended because its *client* went away is not an upstream failure: it gets no
code, and the Reporter records it as the allowed request it was.

Those hooks see a server connection, not a flow: the failure waits on the client
connection's state (ConnState.open_failure) until the flow's ``error`` hook, which comes
next, takes it (an HTTP/1 connection carries one request at a time). The code and detail
go into FlowState; from there the Reporter records the one event (audit log, metrics,
EGRESS_UPSTREAM_ERROR lines) and egress's HTTP/1 server side (limits.StrictHttp1Server)
answers the client with egress's 502/504 (``X-Egress-Error``, ``EGRESS_UPSTREAM_ERROR``
body) in place of mitmproxy's page. Runs before the Reporter.

The detail is cut to DETAIL_CHARS characters: mitmproxy's messages can carry what the upstream
sent (``unexpected server response: b'...'`` held a repr of a whole 32 MiB response head, and
became a 32 MiB 502 body, a 32 MiB log line and a key of the redactor's cache). What the client,
the audit log and the person get is the start of it, never the upstream's bytes whole.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import server_hooks
from mitmproxy.tls import TlsData

from egress.proxy import mitm
from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state, refused
from egress.proxy.refusal import take_dial_refusal

# OpenSSL verification results that mean "no trusted CA signed this chain" (x509_vfy.h):
# UNABLE_TO_GET_ISSUER_CERT, DEPTH_ZERO_SELF_SIGNED_CERT, SELF_SIGNED_CERT_IN_CHAIN,
# UNABLE_TO_GET_ISSUER_CERT_LOCALLY, UNABLE_TO_VERIFY_LEAF_SIGNATURE, CERT_UNTRUSTED. Only
# these are fixed by trusting another CA; an expired certificate or one for another name is not.
UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21, 27})
UPSTREAM_CA_HINT = "if a proxy on your network re-signs TLS, pass its CA with --upstream-ca FILE"
VERIFY_PREFIX = "Certificate verify failed: "  # mitmproxy's words before OpenSSL's reason
DETAIL_CHARS = 300  # of an upstream failure's detail: enough for any cause mitmproxy or OpenSSL words


class UpstreamErrors:
    def __init__(self, engine: Engine):
        self.engine = engine

    @guard
    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        conn = self.engine.conn(data.client)
        if conn.dial_refusal is not None:  # refused by a guard (egress.proxy.refusal): not an upstream failure
            return
        message = data.server.error or "the connection could not be opened"
        conn.open_failure = ("connect-failed", message, message)

    @guard
    def tls_failed_server(self, data: TlsData) -> None:
        message = data.conn.error or "the TLS handshake failed"
        code, detail = classify_tls_failure(message, _verify_result(data))
        self.engine.conn(data.context.client).open_failure = (code, detail, message)

    @guard
    def error(self, flow: http.HTTPFlow) -> None:
        if refused(flow) or flow.error is None or take_dial_refusal(self.engine, flow):
            return
        state = flow_state(flow)
        conn = self.engine.connections.get(flow.client_conn)
        failure = conn.open_failure if conn is not None else None
        if conn is not None:
            conn.open_failure = None
        if state.upstream_error is not None:  # named where it happened (a timeout)
            state.upstream_detail = short(state.upstream_detail or flow.error.msg)
        elif failure is not None and failure[2] in flow.error.msg:
            state.upstream_error, state.upstream_detail = failure[0], short(failure[1])
        elif not flow.client_conn.state & ConnectionState.CAN_READ:
            return  # the client went away first: not the upstream's failure
        else:
            state.upstream_error, state.upstream_detail = "connect-failed", short(flow.error.msg)


def short(detail: str) -> str:
    """``detail`` cut to DETAIL_CHARS characters (``...`` says it was)."""
    return detail if len(detail) <= DETAIL_CHARS else detail[:DETAIL_CHARS - 3] + "..."


def classify_tls_failure(message: str, verify_result: int) -> tuple[str, str]:
    """(code, detail) for a failed upstream TLS handshake: mitmproxy's ``message`` and
    OpenSSL's verification result (0: the certificate was not the problem)."""
    if verify_result == 0 and not message.startswith(VERIFY_PREFIX):
        return "tls-failed", message
    reason = message[len(VERIFY_PREFIX):] if message.startswith(VERIFY_PREFIX) else message
    if verify_result in UNKNOWN_ISSUER:
        return "upstream-certificate", f"{reason}; {UPSTREAM_CA_HINT}"
    return "upstream-certificate", reason


def _verify_result(data: TlsData) -> int:
    try:
        return mitm.verify_result(data.ssl_conn)
    except Exception:  # no handshake state to ask: judge by the message alone
        return 0
