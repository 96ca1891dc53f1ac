"""Credentials never leave: find them in a request, refuse or mask them, broker the bound ones.

Where a request can hold a secret: the URL (host labels, path, query, userinfo),
every header (Basic auth and cookies included: the detector decodes base64 and
percent layers), and the body (decoded from gzip/deflate/br first; an encoding we
cannot read is refused: fail closed).

* ``block`` (default): the request is refused before it leaves, ``reason=credential``,
  naming the kind (``github-token``) and where it was, never the value.
* ``mask``: the value is replaced by ``[redacted:<kind>]`` and the request goes on.
* A stored secret bound to hosts passes to those hosts (and their subdomains) only.
* Brokered secrets: the command holds a placeholder; on a TLS-intercepted request to
  the secret's own hosts the placeholder is swapped for the real value; anywhere else
  the placeholder itself is refused. A request carrying a swapped-in secret may not
  use a method that echoes it back (TRACE, TRACK).

Bodies larger than mitmproxy's streaming threshold are scanned chunk by chunk;
there a finding ends the request (both connections are closed) in either mode,
since bytes already relayed cannot be called back.
"""

from __future__ import annotations

import base64
import bisect
import json
import urllib.parse

from mitmproxy import ctx, http

from .. import refusal
from ..credentials import Credentials, StoredSecret
from ..detect import Detector, UndecodableBody, decode_content
from ..engine import Engine, client_label
from ..policy import Decision, Policy

ECHO_METHODS = {"TRACE", "TRACK"}
BODY_SCAN_LIMIT = 64 * 2**20  # decoded bytes; a bigger (bomb) body is refused
PLACEHOLDER_LABEL = "placeholder"


class CredentialGuard:
    def __init__(self, engine: Engine, credentials: Credentials):
        self.engine = engine
        self.action = credentials.action
        self.ignore_kinds = credentials.ignore_kinds
        self.secrets = credentials.secrets
        labelled = [(s.label, s.value) for s in credentials.secrets]
        labelled += [(f"{PLACEHOLDER_LABEL}:{s.label}", s.placeholder) for s in credentials.brokered]
        self.detector = Detector(labelled)
        # Host names reach DNS lower-cased: a secret written in upper case must still be seen.
        self.host_detector = Detector([(label, value.lower()) for label, value in labelled])
        # Nothing a person or a log reads may carry a secret: events, refusals, metric labels.
        engine.recorder.clean = self.clean
        self._cleaned: dict[str, str] = {}
        self._host_findings: dict[str, object] = {}
        # For each bound secret, the hosts it may reach, with the policy's own matching rules.
        self._bindings = [(s, Policy.from_mapping({"allow": list(s.hosts)}, path=f"<{s.label} hosts>"))
                          for s in credentials.secrets if s.hosts]

    # ------------------------------------------------------------------ hooks

    def clean(self, text: str) -> str:
        """``text`` with every secret in it replaced by [redacted:<kind>]."""
        if not text:
            return text
        cached = self._cleaned.get(text)
        if cached is None:
            if len(self._cleaned) > 4096:  # host names repeat; keep the cache bounded
                self._cleaned.clear()
            cached = self._cleaned[text] = self._clean(text)
        return cached

    def _clean(self, text: str) -> str:
        data = text.encode("utf-8", "surrogateescape")
        cleaned = self.detector.redact(data)
        if self.host_detector.scan(cleaned.lower()):
            cleaned = self.host_detector.redact(cleaned.lower())
        return cleaned.decode("utf-8", "surrogateescape")

    def _host_finding(self, host: str):
        """The first credential in a host name, as written or as it will be resolved."""
        if host not in self._host_findings:
            if len(self._host_findings) > 4096:
                self._host_findings.clear()
            findings = [f for f in self.detector.scan_text(host) or self.host_detector.scan_text(host.lower())
                        if f.kind not in self.ignore_kinds]
            self._host_findings[host] = findings[0] if findings else None
        return self._host_findings[host]

    def _scan(self, data: bytes):
        """Findings that count: all but the well-known kinds this install lets through."""
        findings = self.detector.scan(data)
        if self.ignore_kinds and findings:
            findings = [f for f in findings if f.kind not in self.ignore_kinds]
        return findings

    def http_connect(self, flow: http.HTTPFlow) -> None:
        # Before any DNS query: a lookup of <token>.attacker.example would carry the token out.
        if flow.response is None:
            finding = self._host_finding(flow.request.host)
            if finding is not None:
                self._refuse(flow, flow.request.host, finding.kind, "the host name")

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        message = flow.websocket.messages[-1]
        if not message.from_client:
            return
        host = flow.metadata.get("egress.host") or flow.request.host
        bound = self._bound_to(host)
        findings = self._scan(_neutralise(message.content, bound))
        if findings:
            message.drop()
            detail = f"{findings[0].kind} in a WebSocket message"
            self.engine.record_refusal(client_label(flow.client_conn.peername), "WEBSOCKET",
                                       Decision(host, flow.request.port, False, "credential", detail=detail))
            flow.kill()

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        # A bound host may reflect what it received (echo endpoints, error pages): the command
        # must get back the placeholder it sent, never the real value.
        if not flow.metadata.get("egress.substituted") or flow.response is None:
            return
        brokered = [s for s in self._bound_to(flow.metadata.get("egress.host") or flow.request.host)
                    if s.placeholder]
        pairs = [(s.value.encode(), s.placeholder.encode()) for s in brokered]
        flow.response.headers.fields = tuple(
            (name, _replace_all(value, pairs)) for name, value in flow.response.headers.fields)
        flow.response.stream = _Replacer(pairs)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        host = flow.metadata.get("egress.host") or flow.request.host
        bound = self._bound_to(host)
        intercepted = flow.request.scheme == "https"
        if intercepted and self._substitute_head(flow, bound):
            flow.metadata["egress.substituted"] = True
            if flow.request.method.upper() in ECHO_METHODS:
                self._refuse(flow, host, "a brokered secret", f"{flow.request.method} would echo it back")
                return
        found = self._scan_head(flow, host, bound)
        if found and not self._act_on_head(flow, host, found):
            return
        codings = [c.strip().lower() for c in flow.request.headers.get("transfer-encoding", "").split(",") if c.strip()]
        if any(c not in ("chunked", "identity") for c in codings):
            self._refuse(flow, host, "an unreadable body", f"transfer-encoding {', '.join(codings)!r}")
            return
        # A large upload is scanned as it streams. So is one of unknown length (chunked):
        # mitmproxy would switch it to streaming past 1 MiB, after this hook, unscanned.
        if flow.request.stream or (codings and "content-length" not in flow.request.headers):
            flow.request.stream = _StreamGuard(self, flow, host, bound)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.stream or not flow.request.raw_content:
            return
        host = flow.metadata.get("egress.host") or flow.request.host
        bound = self._bound_to(host)
        encoding = flow.request.headers.get("content-encoding", "")
        try:
            body = decode_content(flow.request.raw_content, encoding, BODY_SCAN_LIMIT) if encoding \
                else flow.request.raw_content
        except UndecodableBody as e:
            self._refuse(flow, host, "an unreadable body", f"content-encoding {encoding!r}: {e}")
            return
        if flow.request.scheme == "https" and bound:
            substituted = self._swap(body, bound)
            if substituted != body:
                body = substituted
                flow.request.content = body  # mitmproxy re-encodes and fixes Content-Length
                flow.metadata["egress.substituted"] = True
        findings = self._scan(_neutralise(body, bound))
        if not findings:
            return
        refused = [f for f in findings if self._must_refuse(f.kind)]
        if refused:
            self._refuse(flow, host, refused[0].kind, "the body")
            return
        flow.request.content = _mask(body, findings)
        self._record_mask(flow, host, findings, "the body")

    # -------------------------------------------------------------- bindings

    def _bound_to(self, host: str) -> list[StoredSecret]:
        """The bound secrets that may go to ``host``."""
        return [secret for secret, hosts in self._bindings if hosts.decide(host).allowed]

    def _swap(self, data: bytes, bound: list[StoredSecret]) -> bytes:
        for secret in bound:
            if secret.placeholder:
                data = data.replace(secret.placeholder.encode(), secret.value.encode())
        return data

    def _substitute_head(self, flow: http.HTTPFlow, bound: list[StoredSecret]) -> bool:
        brokered = [s for s in bound if s.placeholder]
        if not brokered:
            return False
        changed = False
        path = flow.request.path
        for secret in brokered:
            for fake, real in _forms(secret.placeholder, secret.value):
                if fake in path:
                    path, changed = path.replace(fake, real), True
        if changed:
            flow.request.path = path
        fields = []
        for name, value in flow.request.headers.fields:
            new = self._swap(value, brokered)
            if name.lower() == b"authorization" and new[:6].lower() == b"basic ":
                new = _swap_basic(new, brokered)
            changed |= new != value
            fields.append((name, new))
        flow.request.headers.fields = tuple(fields)
        return changed

    # ---------------------------------------------------------------- scanning

    def _scan_head(self, flow: http.HTTPFlow, host: str, bound: list[StoredSecret]):
        """Findings in the host, the URL and each header: [(where, finding, field index)]."""
        found = []
        finding = self._host_finding(host)
        if finding is not None:
            found.append(("the host name", finding, None))
        target = flow.request.path.encode("utf-8", "surrogateescape")
        for finding in self._scan(_neutralise(target, bound)):
            found.append(("the URL", finding, "path"))
        # All header values in one scan (one pass of the prefilter), mapped back to their header.
        values, starts, at = [], [], 0
        for name, value in flow.request.headers.fields:
            scanned = _neutralise(value, bound)
            if name.lower() == b"authorization" and scanned[:6].lower() == b"basic ":
                scanned = _neutralise_basic(scanned, bound)
            values.append(scanned)
            starts.append(at)
            at += len(scanned) + 1
        fields = flow.request.headers.fields
        for finding in self._scan(b"\n".join(values)):
            index = bisect.bisect_right(starts, finding.start) - 1
            local = finding._replace(start=finding.start - starts[index], end=finding.end - starts[index])
            found.append((f"the {fields[index][0].decode('latin-1')} header", local, index))
        return found

    def _must_refuse(self, kind: str) -> bool:
        return self.action == "block" or kind.startswith(PLACEHOLDER_LABEL + ":")

    def _act_on_head(self, flow: http.HTTPFlow, host: str, found) -> bool:
        """Refuse or mask what was found in the URL and headers; False if refused."""
        for where, finding, field in found:
            if self._must_refuse(finding.kind) or field is None:
                self._refuse(flow, host, finding.kind, where)
                return False
        path = flow.request.path.encode("utf-8", "surrogateescape")
        path_findings = [f for _, f, field in found if field == "path"]
        if path_findings:
            flow.request.path = _mask(path, path_findings).decode("utf-8", "surrogateescape")
        fields = list(flow.request.headers.fields)
        for index in {field for _, _, field in found if isinstance(field, int)}:
            name, value = fields[index]
            header_findings = [f for _, f, field in found if field == index]
            fields[index] = (name, _mask(value, header_findings))
        flow.request.headers.fields = tuple(fields)
        self._record_mask(flow, host, [f for _, f, _ in found], ", ".join(sorted({w for w, _, _ in found})))
        return True

    # ---------------------------------------------------------------- outcomes

    def _refuse(self, flow: http.HTTPFlow, host: str, kind: str, where: str) -> None:
        detail = f"{kind} in {where}"
        host = self.clean(host)
        flow.response = refusal.refusal(host, "credential", detail)
        flow.metadata["egress.refused"] = True
        self.engine.record_refusal(client_label(flow.client_conn.peername), flow.request.method,
                                   Decision(host, flow.request.port, False, "credential", detail=detail))

    def _record_mask(self, flow: http.HTTPFlow, host: str, findings, where: str) -> None:
        kinds = ", ".join(sorted({f.kind for f in findings}))
        flow.metadata["egress.masked"] = f"{kinds} in {where}"
        self.engine.recorder.metrics.requests.labels("mask", "credential").inc()


def _forms(fake: str, real: str):
    """A placeholder and its value as they appear raw, percent-encoded and JSON-escaped."""
    yield fake, real
    quoted = urllib.parse.quote(fake, safe="")
    if quoted != fake:
        yield quoted, urllib.parse.quote(real, safe="")


def _neutralise(data: bytes, bound: list[StoredSecret]) -> bytes:
    """``data`` with the values allowed to go to this host blanked out (for scanning only)."""
    for secret in bound:
        for form in _value_forms(secret.value):
            if form in data:
                data = data.replace(form, b"x" * len(form))
    return data


def _value_forms(value: str) -> list[bytes]:
    forms = {value.encode(), urllib.parse.quote(value, safe="").encode(),
             json.dumps(value)[1:-1].encode()}
    return sorted(forms, key=len, reverse=True)


def _decode_basic(value: bytes) -> bytes | None:
    try:
        return base64.b64decode(value[6:].strip(), validate=True)
    except ValueError:
        return None


def _neutralise_basic(value: bytes, bound: list[StoredSecret]) -> bytes:
    decoded = _decode_basic(value)
    if decoded is None:
        return value
    cleaned = _neutralise(decoded, bound)
    return value if cleaned == decoded else b"Basic " + base64.b64encode(cleaned)


def _swap_basic(value: bytes, brokered: list[StoredSecret]) -> bytes:
    decoded = _decode_basic(value)
    if decoded is None:
        return value
    swapped = decoded
    for secret in brokered:
        swapped = swapped.replace(secret.placeholder.encode(), secret.value.encode())
    return value if swapped == decoded else b"Basic " + base64.b64encode(swapped)


def _replace_all(data: bytes, pairs) -> bytes:
    for real, fake in pairs:
        data = data.replace(real, fake)
    return data


class _Replacer:
    """A response stream function putting placeholders back where the real values were echoed.

    Holds back the last len(value) - 1 bytes of each chunk, so a value split across
    chunks is still found.
    """

    def __init__(self, pairs):
        self.pairs = pairs
        self.keep = max((len(real) for real, _ in pairs), default=1) - 1
        self.tail = b""

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:  # end of body
            out, self.tail = _replace_all(self.tail, self.pairs), b""
            return out
        data = _replace_all(self.tail + chunk, self.pairs)
        if self.keep <= 0 or len(data) <= self.keep:
            self.tail = data if self.keep > 0 else b""
            return b"" if self.keep > 0 else data
        self.tail = data[-self.keep:]
        return data[:-self.keep]


def _mask(data: bytes, findings) -> bytes:
    out, last = [], 0
    for finding in sorted(findings, key=lambda f: f.start):
        out.append(data[last:finding.start])
        out.append(f"[redacted:{finding.kind}]".encode())
        last = finding.end
    out.append(data[last:])
    return b"".join(out)


class _StreamGuard:
    """A mitmproxy stream function: scans an upload as it streams; a finding ends the request.

    The last ``detector.overlap`` bytes are held back until the next chunk has been
    scanned with them: a token that starts near the end of one chunk is complete by
    then, and none of its bytes has left.
    """

    def __init__(self, guard: CredentialGuard, flow: http.HTTPFlow, host: str, bound: list[StoredSecret]):
        self.guard, self.flow, self.host, self.bound = guard, flow, host, bound
        self.keep = guard.detector.overlap
        self.held = b""
        self.stopped = False

    def __call__(self, chunk: bytes) -> bytes:
        if self.stopped:
            return b""
        window = self.held + chunk
        findings = self.guard._scan(_neutralise(window, self.bound))
        if findings:
            self._stop(findings[0].kind)
            return b""
        if not chunk:  # end of body: the rest has been scanned
            self.held = b""
            return window
        cut = max(0, len(window) - self.keep)
        self.held = window[cut:]
        return window[:cut]

    def _stop(self, kind: str) -> None:
        self.stopped = True
        self.flow.metadata["egress.refused"] = True
        self.guard.engine.record_refusal(client_label(self.flow.client_conn.peername), self.flow.request.method,
                                         Decision(self.host, self.flow.request.port, False, "credential",
                                                  detail=f"{kind} in the body"))
        _abort(self.flow)


def _abort(flow: http.HTTPFlow) -> None:
    """Close both sides of a flow whose bytes are already moving."""
    handler = ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)
    if handler is None:
        return
    for connection in (flow.server_conn, flow.client_conn):
        transport = handler.transports.get(connection)
        if transport is not None and transport.writer is not None:
            transport.writer.close()
