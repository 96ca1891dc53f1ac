"""Labels text responses that carry prompt-injection signals (off by default: --label-injection).

A response an agent will read (text, HTML, JSON, XML, markdown) whose body is small enough to be
read whole (a Content-Length up to LABEL_MAX_BYTES, any content coding mitmproxy decodes) is
scored with egress.agent.fence.score before it is answered; if a signal is found, the response gets a
header naming them, and its event's detail says so::

    X-Egress-Injection: score=0.88; signals=ignore-instructions,exfiltration

Streamed bodies are never buffered for this: a response without a Content-Length (chunked, a
server-sent event stream), a larger one, or one another guard already streams (every response
from a host a brokered secret is bound to) passes as it came, unlabelled; the header can only go out with the head,
before the body. Runs before the Reporter, which counts the bytes of a body read whole.
"""

from __future__ import annotations

from mitmproxy import http

from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state, refused

LABEL_MAX_BYTES = 256 * 1024
HEADER = "X-Egress-Injection"
_TEXT_TYPES = ("text/", "application/json", "application/xml", "application/xhtml", "application/javascript",
               "application/markdown", "application/x-ndjson")


class InjectionLabel:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.enabled = False

    def load(self, loader) -> None:
        loader.add_option("egress_label_injection", bool, False,
                          "Label small text responses carrying prompt-injection signals with a header.")

    def configure(self, updated) -> None:
        if "egress_label_injection" in updated:
            from mitmproxy import ctx

            self.enabled = bool(ctx.options.egress_label_injection)

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if not self.enabled or response is None or refused(flow) or response.stream:
            return
        kind = response.headers.get("content-type", "").lower()
        if not (kind.startswith(_TEXT_TYPES) or "+json" in kind or "+xml" in kind):
            return
        try:
            length = int(response.headers.get("content-length", ""))
        except ValueError:
            return  # no length: it streams, unlabelled
        if 0 < length <= LABEL_MAX_BYTES:
            flow_state(flow).whole = True  # read whole (bounded), scored in `response`

    @guard
    def response(self, flow: http.HTTPFlow) -> None:
        state = flow_state(flow)
        if not state.whole or refused(flow) or flow.response is None:
            return
        from egress.agent.fence import score

        text = flow.response.get_text(strict=False) or ""
        found = score(text)
        if found.signals:
            label = f"score={found.score:g}; signals={','.join(found.names)}"
            flow.response.headers[HEADER] = label
            state.injection = label
