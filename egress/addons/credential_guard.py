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
        self.secrets = credentials.secrets
        labelled = [(s.label, s.value) for s in credentials.secrets]
        labelled += [(f"{PLACEHOLDER_LABEL}:{s.label}", s.placeholder) for s in credentials.brokered]
        self.detector = Detector(labelled)
        # For each bound secret, the hosts it may reach, with the policy's own matching rules.
        self._bindings = [(s, Policy.from_mapping({"allow": list(s.hosts)}, path=f"<{s.label} hosts>"))
                          for s in credentials.secrets if s.hosts]

    # ------------------------------------------------------------------ hooks

    def http_connect(self, flow: http.HTTPFlow) -> None:
        # Before any DNS query: a lookup of <token>.attacker.example would carry the token out.
        if flow.response is None:
            for finding in self.detector.scan_text(flow.request.host):
                self._refuse(flow, flow.request.host, finding.kind, "the host name")
                return

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
        if flow.request.stream:  # a large upload: scanned as it streams
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
        findings = self.detector.scan(_neutralise(body, bound))
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
        for finding in self.detector.scan_text(host):
            found.append(("the host name", finding, None))
        target = flow.request.path.encode("utf-8", "surrogateescape")
        for finding in self.detector.scan(_neutralise(target, bound)):
            found.append(("the URL", finding, "path"))
        for index, (name, value) in enumerate(flow.request.headers.fields):
            scanned = _neutralise(value, bound)
            if name.lower() == b"authorization" and scanned[:6].lower() == b"basic ":
                scanned = _neutralise_basic(scanned, bound)
            for finding in self.detector.scan(scanned):
                found.append((f"the {name.decode('latin-1')} header", finding, index))
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


def _mask(data: bytes, findings) -> bytes:
    out, last = [], 0
    for finding in sorted(findings, key=lambda f: f.start):
        out.append(data[last:finding.start])
        out.append(f"[redacted:{finding.kind}]".encode())
        last = finding.end
    out.append(data[last:])
    return b"".join(out)


class _StreamGuard:
    """A mitmproxy stream function: scans an upload chunk by chunk; a finding ends the request."""

    def __init__(self, guard: CredentialGuard, flow: http.HTTPFlow, host: str, bound: list[StoredSecret]):
        self.guard, self.flow, self.host, self.bound = guard, flow, host, bound
        self.scanner = guard.detector.stream()
        self.stopped = False

    def __call__(self, chunk: bytes) -> bytes:
        if self.stopped:
            return b""
        findings = self.scanner.feed(_neutralise(chunk, self.bound)) if chunk else self.scanner.finish()
        if not findings:
            return chunk
        self.stopped = True
        kind = findings[0].kind
        detail = f"{kind} in the body"
        self.flow.metadata["egress.refused"] = True
        self.guard.engine.record_refusal(client_label(self.flow.client_conn.peername), self.flow.request.method,
                                         Decision(self.host, self.flow.request.port, False, "credential",
                                                  detail=detail))
        _abort(self.flow)
        return b""


def _abort(flow: http.HTTPFlow) -> None:
    """Close both sides of a flow whose bytes are already moving."""
    handler = ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)
    if handler is None:
        return
    for connection in (flow.server_conn, flow.client_conn):
        transport = handler.transports.get(connection)
        if transport is not None and transport.writer is not None:
            transport.writer.close()
