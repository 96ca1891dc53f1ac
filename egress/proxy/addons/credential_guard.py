"""Credentials: find them in what leaves, refuse or mask them, broker the bound ones.

Where a request can hold a secret: the host name (before any DNS query), the method, the
URL (path, query, userinfo), every header name and value (Basic auth and cookies included:
the detector decodes base64 and percent layers), the body, and WebSocket messages (each
with the end of the ones before it: a token split across them) and control frames (ping,
pong, close).

* ``block`` (default): the request is refused before it leaves, ``reason=credential``,
  naming the kind (``github-token``) and where it was, never the value.
* ``mask``: a value in the URL, a header value or a buffered body is replaced by
  ``[redacted:<kind>]`` and the request goes on (a method or header name cannot be masked:
  refused).
* A stored secret bound to hosts passes to those hosts (and their subdomains) only.
* Brokered secrets: the command holds a placeholder. On a TLS-intercepted request to the
  secret's own hosts the placeholder is swapped for the real value only where the secret
  is declared to go (its ``header`` names, default Authorization; the body, query or path
  if its ``swap`` opts in); a placeholder anywhere else, or on any other host, is refused.
  A request carrying a swapped-in secret may not use a method that echoes it back (TRACE,
  TRACK). Every response from a host a brokered secret is bound to, whatever its request
  carried (such a host keeps what it was sent and may show it on a later request), is read
  for the real value in every layer the detector reads: the status line, each header and
  trailer, the body (as labelled, as sent, and as gzip/zlib/zstd when it starts like one
  whatever its headers say) and WebSocket messages (across messages). A value found raw or
  %-escaped is put back to its placeholder in place (same length); anywhere else the
  response is cut off, with an event naming the secret and where.

One scanner behind every body: :class:`_BodyScan` undoes the content coding piece by
piece (gzip, deflate, br, zstd; an unknown one is refused before a byte is relayed) and
feeds a :class:`~egress.scan.detect.StreamScanner` in looks of a few ms, within a time budget
shared by everything one client address sends (SCAN_BURST). It reads a body as any
receiver could: decoded; a coded one as sent too (gzip's name, comment and extra fields,
zstd's skippable frames, brotli's metadata: decoders skip them); UTF-16 or UTF-32 text (a
byte-order mark, a charset, an XML declaration, or its NULs in the first 512 bytes)
transcoded to UTF-8 too. A finding in those other readings cannot be masked or put back:
the body is refused (a response cut off) whatever the action. Buffered bodies,
streamed uploads (chunked, or over mitmproxy's 1 MiB stream_large_bodies), WebSocket
messages and control frames, and brokered responses all go through it. A streamed body is
relayed only as far as it has been scanned (the held-back rule: no byte of a token split
across chunks leaves before the token has been seen); a finding there ends the request in
either mode (both connections closed), since bytes already relayed cannot be called back.
Its scanning runs for a few ms in each of mitmproxy's synchronous calls and goes on between
reads, while that connection is read no further (_Relay); its decoder and scanners are let
go as soon as it ends, is refused, or its flow fails.

Every refusal of this guard is made by :meth:`CredentialGuard._refusal` (reason ``credential``, the
detail naming the kind and where, never the value): raised from a hook, carried out by
egress.proxy.refusal at its stage (the request answered, the response killed, a stream's
connections closed, a WebSocket closed with 1008).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import codecs
import contextlib
import json
import re
import time
import urllib.parse
from collections import deque

import wsproto.events
from mitmproxy import http

from egress.policy.loader import policy_from_mapping
from egress.policy.matcher import Decision
from egress.proxy import mitm
from egress.proxy.connect import ConnectContext
from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state
from egress.proxy.mitm import websocket_layer
from egress.proxy.refusal import Refused, Stage, refuse
from egress.scan.credentials import Credentials, StoredSecret
from egress.scan.decode import KNOWN_CODINGS, ContentDecoder, UndecodableBody, WindowTooLarge, codings
from egress.scan.detect import Detector, Finding
from egress.scan.host_secrets import HostSecrets

ECHO_METHODS = {"TRACE", "TRACK"}
BODY_SCAN_LIMIT = 64 * 2**20  # decoded bytes; a bigger (bomb) body is refused
PLACEHOLDER_LABEL = "placeholder"
SLICE = 64 * 1024  # the most decoded bytes one piece of work makes between looks at the budget
# A body is scanned in looks (_Reading): each takes about LOOK of CPU at the speed the last
# one went, and the budget is looked at after each. The most a look scans anew is SCAN_BATCH:
# with the 16 KiB carried from one look to the next, each byte is scanned 1.06 times, against
# 1.25 with a look per 64 KiB chunk as a socket read delivers them (with the url-password
# prefilter change, a clean-text upload took 1.2x less CPU per GB, side by side:
# bench/README.md); text that scans at 0.02 us a byte or faster (ordinary text, JSON, code)
# gets there from the second look. The least a look scans anew is the 16 KiB it carries
# (Detector.overlap): 32 KiB of the slowest text known (a run of "sk-") take ~19 ms.
SCAN_BATCH = 256 * 1024
LOOK = 0.005

# The scanning time budget, in CPU seconds of the proxy's one event-loop thread (thread_time:
# other processes on the machine do not count). A client's request body or WebSocket message
# earns SCAN_PER_BYTE for every byte it sends (as sent, before decoding), and pays for each
# piece of decoding and each look of scanning; what its bytes do not cover is taken from its
# client address's bucket (_Bucket), shared by all of that address's connections and requests:
# SCAN_BURST at most, refilled at SCAN_RATE a second. A body is refused ("scan budget spent")
# when both are spent. So a client buys no more scanning than 1 us a byte it sends, plus
# SCAN_BURST once and SCAN_RATE a second: a flood of small compressed bombs gets its later
# requests refused after a look each. Responses and messages from a server have SCAN_BURST of
# their own, and earn as a client does (capped at SCAN_BURST).
# Measured (bench/scanner_bench.py --wedge, 2 vCPU): ordinary traffic costs ~0.02 us of CPU a
# byte, the slowest ordinary text (a token-like prefix every ~40 bytes, runs of PEM headers)
# 0.1-0.25 us. 1 us a sent byte covers any uncompressed body 4x over, and compressed ones up to
# ~4:1 of the slowest text or ~40:1 of ordinary text; the bucket covers the rest of an honest
# client's. A 30 KB gzip of PEM headers (12 MiB decoded, 20 s of scanning before issue 9) is
# refused after ~0.3 s, and that client's next such request after a look.
SCAN_BURST = 0.25
SCAN_PER_BYTE = 1e-6
SCAN_RATE = 0.05
BUCKETS_KEPT = 16384  # client addresses whose bucket is kept (a full one is the same as none)
# How long one client's scanning holds every other client up. Buffered bodies and WebSocket
# messages give the event loop back after each look. A streamed body is scanned inside
# mitmproxy's synchronous stream call: STREAM_CALL of CPU a call at most, the rest between reads
# (_Relay); the call at the body's end has to finish, within STREAM_END (a read of ordinary
# text takes ~0.5-2 ms; 64 KiB of the slowest known, ~37 ms). STREAM_QUEUE: bytes a stream may
# have waiting when nothing holds its client back (never, inside mitmproxy).
STREAM_CALL = 0.005
STREAM_END = 0.05
STREAM_QUEUE = 4 * 2**20
WS_TAIL = 4096  # bytes of the client's last WebSocket messages read again with the next one
CLEAN_CACHED = 256  # characters: longer texts are cleaned each time, not kept


class CredentialGuard:
    def __init__(self, engine: Engine, credentials: Credentials, *, burst: float = SCAN_BURST,
                 per_byte: float = SCAN_PER_BYTE, rate: float = SCAN_RATE):
        self.engine = engine
        self.action = credentials.action
        self.ignore_kinds = frozenset(credentials.ignore_kinds)
        self.secrets = credentials.secrets
        self.burst, self.per_byte, self.rate = burst, per_byte, rate
        self._buckets: dict[str, _Bucket] = {}  # client address -> its scan time (_Bucket)
        labelled = [(s.label, s.value) for s in credentials.secrets]
        labelled += [(f"{PLACEHOLDER_LABEL}:{s.label}", s.placeholder) for s in credentials.brokered]
        # Stored secrets match in any case: host names reach DNS lower-cased, and an
        # upper-cased secret is the same secret.
        self.detector = Detector(labelled)
        # What a response to a request with a swapped-in secret must not give back.
        self.brokered = {s.label: s for s in credentials.brokered}
        self.echo_detector = Detector([(s.label, s.value) for s in credentials.brokered], formats=False) \
            if self.brokered else None
        # Each brokered value as a header carries it (raw, %-escaped, JSON-escaped), and its placeholder.
        self._put_back_forms = [(real.encode(), fake.encode()) for s in credentials.brokered
                                for real, fake in _forms(s.value, s.placeholder)]
        # How much of a bound host's WebSocket messages is read again with the next one: the
        # longest form the detector reads a value in (two layers of %-escaping: 9 bytes a byte).
        self._echo_tail = 9 * max((len(s.value) for s in credentials.brokered), default=0) + 64
        # How much of the client's WebSocket messages is read again with the next one: a token
        # split across messages is one token to a server that joins them. Tokens and their
        # encoded forms fit in 4 KiB; a stored secret's longest form may not.
        self._client_tail = max(WS_TAIL, 9 * max((len(s.value) for s in credentials.secrets), default=0) + 64)
        # Nothing a person or a log reads may carry a secret: events, refusals, metric labels.
        engine.recorder.clean = self.clean
        self._cleaned: dict[str, str] = {}
        self.host_secrets = HostSecrets(self.detector, self.ignore_kinds)
        # A CONNECT's host name is read in its decision (egress.proxy.connect.check_name), on both
        # of serve's paths; until the engine takes the reader as an argument, it is given here.
        engine.host_names = self
        # For each bound secret, the hosts it may reach, with the policy's own matching rules.
        self._bindings = [(s, policy_from_mapping({"allow": list(s.hosts)}, path=f"<{s.label} hosts>"))
                          for s in credentials.secrets if s.hosts]

    # ------------------------------------------------------------------ hooks

    def clean(self, text: str) -> str:
        """``text`` with every secret in it replaced by [redacted:<kind>]."""
        if not text:
            return text
        cached = self._cleaned.get(text)
        if cached is None:
            data = text.encode("utf-8", "surrogateescape")
            cached = self.detector.redact(data).decode("utf-8", "surrogateescape")
            # and what only a host name's reading finds (a token split by dots, lower-cased, glued)
            cached = self.host_secrets.redact(cached)
            # Host names and refusal details repeat; a long text (an upstream's answer quoted in
            # an error) is rarely seen twice and would pin its size, twice, in the cache.
            if len(text) <= CLEAN_CACHED:
                if len(self._cleaned) > 4096:  # keep the cache bounded
                    self._cleaned.clear()
                self._cleaned[text] = cached
        return cached

    def connect_refusal(self, ctx: ConnectContext) -> Decision | None:
        """A CONNECT's refusal for a credential in its host name as the client wrote it, or None
        (egress.proxy.connect.check_name: before any DNS query, a lookup of
        <token>.attacker.example would carry the token out)."""
        finding = self.host_secrets.first(ctx.written)
        if finding is None:
            return None
        detail = f"{finding.kind} in the host name"
        detail += self._placeholder_note(ctx.written, detail)
        return Decision(ctx.written, ctx.port, False, "credential", detail=detail)

    @guard
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        host = _host(flow)
        bound = self._bound_to(host)
        intercepted = flow.request.scheme == "https"
        if intercepted and self._substitute_head(flow, bound):
            flow_state(flow).substituted = True
            if flow.request.method.upper() in ECHO_METHODS:
                raise self._refusal(flow, host,
                                    f"a brokered secret in the request ({flow.request.method} would echo it back)")
        found = self._scan_head(flow, host, bound)
        if found:
            self._act_on_head(flow, host, found)
        transfer = [c.strip().lower() for c in flow.request.headers.get("transfer-encoding", "").split(",") if c.strip()]
        if any(c not in ("chunked", "identity") for c in transfer):
            raise self._refusal(flow, host, f"an unreadable body (transfer-encoding {', '.join(transfer)!r})")
        has_body = transfer or flow.request.headers.get("content-length", "0").strip() not in ("", "0")
        if not has_body:
            return
        # A body in a coding we cannot read is refused now, before any of it can stream.
        encoding = flow.request.headers.get("content-encoding", "")
        unknown = [c for c in codings(encoding) if c not in KNOWN_CODINGS]
        if unknown:
            raise self._refusal(flow, host, f"an unreadable body (content-encoding {unknown[0]!r} is unknown)")
        # A large upload is scanned as it streams. So is one of unknown length (chunked):
        # mitmproxy would switch it to streaming past 1 MiB, after this hook, unscanned.
        if flow.request.stream or (transfer and "content-length" not in flow.request.headers):
            scan = self._body_scan(flow, bound, encoding, streamed=True,
                                   content_type=flow.request.headers.get("content-type", ""))
            flow.request.stream = _Relay(self, flow, host, scan)

    @guard
    def request(self, flow: http.HTTPFlow):
        if flow.response is not None or flow.request.stream or not flow.request.raw_content:
            return None
        work = self._check_body(flow)
        if len(flow.request.raw_content) <= self.detector.overlap and \
                not codings(flow.request.headers.get("content-encoding", "")):
            for _ in work:  # one look: no need to give the loop back
                pass
            return None
        return _drive(work)

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        # A host a brokered secret is bound to holds the real value: it was sent it, and may
        # give it back on any later request, not only in an echo of this one (an issue, a
        # paste, a log that keeps what it was sent; the reason phrase). So every response
        # from it is read before the command gets it, whatever its request carried.
        if flow.response is None or flow_state(flow).refused:
            return
        host = _host(flow)
        if not self._echo_due(flow, host):
            return
        response = flow.response
        response.data.reason = self._unswap(response.data.reason)
        response.headers.fields = tuple((name, self._unswap(value)) for name, value in response.headers.fields)
        status = response.data.http_version + b" " + response.data.reason
        left = self.echo_detector.scan(b"\n".join([status, *(b for field in response.headers.fields for b in field)]))
        if left:
            where = "the status line" if left[0].start < len(status) else "a response header"
            raise self._refusal(flow, host, f"{left[0].kind} given back in {where}", Stage.RESPONSE)
        encoding = response.headers.get("content-encoding", "")
        try:
            scan = _BodyScan(self.echo_detector, encoding, frozenset(), frozenset(), self._budget(streamed=True),
                             content_type=response.headers.get("content-type", ""))
        except UndecodableBody as e:
            raise self._refusal(flow, host, f"a brokered response that cannot be read (content-encoding {encoding!r}: "
                                            f"{e})", Stage.RESPONSE) from None
        # The body is read as a client might read it other than as labelled: a coded body's
        # bytes as sent (the scan does), and an unlabelled body that starts like gzip, zlib or
        # zstd, decoded.
        also = [] if scan.decoder is not None else [_Sniffed(self.echo_detector, lambda: self._budget(streamed=True))]
        response.stream = _Relay(self, flow, host, scan, echo=True, also=also)

    @guard
    def response(self, flow: http.HTTPFlow) -> None:
        # Trailers go to the client after this hook (HTTP/2): read as the headers were.
        response = flow.response
        if response is None or not response.trailers or flow_state(flow).refused:
            return
        host = _host(flow)
        if not self._echo_due(flow, host):
            return
        response.trailers.fields = tuple((name, self._unswap(value)) for name, value in response.trailers.fields)
        left = self.echo_detector.scan(b"\n".join(b for field in response.trailers.fields for b in field))
        if left:
            response.trailers = None
            raise self._refusal(flow, host, f"{left[0].kind} given back in a response trailer", Stage.RESPONSE)

    @guard
    def error(self, flow: http.HTTPFlow) -> None:
        # A flow that failed (its client gone mid-upload, a connection cut): its body's
        # decoder and scanners go now, not when the collector finds the flow.
        for message in (flow.request, flow.response):
            relay = getattr(message, "stream", None)
            relay = getattr(relay, "inner", relay)  # egress.proxy.addons.reporter counts what it relays
            if isinstance(relay, _Relay):
                relay.drop()

    @guard
    def websocket_start(self, flow: http.HTTPFlow) -> None:
        # Messages come to websocket_message; ping, pong and close frames come to no hook:
        # read them (and close the WebSocket when told to) where mitmproxy takes the frames.
        ws = websocket_layer(flow)
        if ws is None:
            return  # websocket_message falls back to closing the connections
        flow_state(flow).websocket_close = False
        for conn, from_client in ((ws.client_ws, True), (ws.server_ws, False)):
            conn.events = _guard_frames(self, flow, from_client, conn.events)

    @guard
    def websocket_message(self, flow: http.HTTPFlow):
        message = flow.websocket.messages[-1]
        if message.injected:
            return None
        work = self._check_message(flow, message)
        if len(message.content) + len(flow_state(flow).client_tail) <= self.detector.overlap:
            for _ in work:
                pass
            return None
        return _drive(work)

    # -------------------------------------------------------------- bindings

    def _bound_to(self, host: str) -> list[StoredSecret]:
        """The bound secrets that may go to ``host``."""
        return [secret for secret, hosts in self._bindings if hosts.decide(host).allowed]

    def _echo_due(self, flow: http.HTTPFlow, host: str) -> bool:
        """Whether what the server sends on this flow is read for brokered values given back:
        it comes from a host a brokered secret is bound to (or carried one: a substituted flow)."""
        if not self.brokered:
            return False
        return flow_state(flow).substituted or any(s.placeholder for s in self._bound_to(host))

    def _substitute_head(self, flow: http.HTTPFlow, bound: list[StoredSecret]) -> bool:
        """Swap placeholders for real values where each secret is declared to go: its
        ``header`` names, and the path or query if its ``swap`` says so. A placeholder left
        anywhere else is then refused by the scan (_scan_head, _check_body)."""
        brokered = [s for s in bound if s.placeholder]
        if not brokered:
            return False
        changed = False
        path, sep, query = flow.request.path.partition("?")
        for secret in brokered:
            for fake, real in _forms(secret.placeholder, secret.value):
                if "path" in secret.swap and fake in path:
                    path, changed = path.replace(fake, real), True
                if "query" in secret.swap and fake in query:
                    query, changed = query.replace(fake, real), True
        if changed:
            flow.request.path = path + sep + query
        fields = []
        for name, value in flow.request.headers.fields:
            lower = name.decode("latin-1").lower()
            mine = [s for s in brokered if "header" in s.swap and lower in s.header_names]
            new = _swap(value, mine) if mine else value
            if mine and lower == "authorization" and new[:6].lower() == b"basic ":
                new = _swap_basic(new, mine)
            changed |= new != value
            fields.append((name, new))
        flow.request.headers.fields = tuple(fields)
        return changed

    def _unswap(self, data: bytes) -> bytes:
        """``data`` with every brokered value, as sent or in the forms a header carries it,
        put back to its placeholder."""
        for real, fake in self._put_back_forms:
            if real in data:
                data = data.replace(real, fake)
        for secret in self.brokered.values():
            if data[:6].lower() == b"basic ":
                decoded = _decode_basic(data)
                if decoded is not None and secret.value.encode() in decoded:
                    data = b"Basic " + base64.b64encode(decoded.replace(secret.value.encode(),
                                                                        secret.placeholder.encode()))
        return data

    # ---------------------------------------------------------------- scanning

    def _counts(self, findings, bound: list[StoredSecret]):
        """Findings that count: not a secret this host may have, not a kind this install lets through."""
        if not findings:
            return findings
        allowed = {s.label for s in bound}
        return [f for f in findings if f.kind not in allowed and f.kind not in self.ignore_kinds]

    def _budget(self, streamed: bool, flow: http.HTTPFlow | None = None) -> _Budget:
        """The budget of what ``flow``'s client sends (its bytes' earnings, then its client's
        bucket), or, without a flow, of what a server sends (SCAN_BURST of its own)."""
        if flow is None:
            return _Budget(self.burst, self.per_byte, self.burst)
        return _Budget(0.0, self.per_byte, self.burst if streamed else float("inf"), self._bucket(flow))

    def _bucket(self, flow: http.HTTPFlow) -> _Bucket:
        peer = flow.client_conn.peername
        address = peer[0] if peer else ""
        bucket = self._buckets.get(address)
        if bucket is None:
            if len(self._buckets) >= BUCKETS_KEPT:
                # a full bucket is the same as none; past that the oldest go (a new address
                # gets SCAN_BURST anyway)
                full = [a for a, b in self._buckets.items() if b.refill() >= b.burst]
                for a in full or list(self._buckets)[:BUCKETS_KEPT // 2]:
                    del self._buckets[a]
            bucket = self._buckets[address] = _Bucket(self.burst, self.rate)
        return bucket

    def _body_scan(self, flow: http.HTTPFlow, bound: list[StoredSecret], encoding: str, streamed: bool,
                   keep: bool = False, **readings) -> _BodyScan:
        """A scan of what ``flow``'s client sends."""
        return _BodyScan(self.detector, encoding, frozenset(s.label for s in bound), self.ignore_kinds,
                         self._budget(streamed, flow), keep, **readings)

    def _scan_head(self, flow: http.HTTPFlow, host: str, bound: list[StoredSecret]):
        """Findings in the host, the URL, the method and each header: [(where, finding, field)];
        field is "path", a header's index (its value, which can be masked) or None (refuse)."""
        found = []
        # As the client wrote it too: the canonical name is lower-cased, and a format with a short
        # word-like prefix (AIza...) is a token only in its own case.
        finding = self.host_secrets.first(flow.request.host) or self.host_secrets.first(host)
        if finding is not None:
            found.append(("the host name", finding, None))
        target = flow.request.path.encode("utf-8", "surrogateescape")
        for finding in self._counts(self.detector.scan(target), bound):
            found.append(("the URL", finding, "path"))
        # The method, then every header name and value, in one scan (one pass of the
        # prefilter), each finding mapped back to where it was.
        fields = flow.request.headers.fields
        parts = [flow.request.data.method] + [b for field in fields for b in field]
        starts, at = [], 0
        for part in parts:
            starts.append(at)
            at += len(part) + 1
        for finding in self._counts(self.detector.scan(b"\n".join(parts)), bound):
            i = bisect.bisect_right(starts, finding.start) - 1
            local = finding._replace(start=finding.start - starts[i], end=finding.end - starts[i])
            if i == 0:
                found.append(("the method", local, None))
            elif i % 2:
                found.append(("a header name", local, None))
            else:
                index = (i - 1) // 2
                found.append((f"the {fields[index][0].decode('latin-1')} header", local, index))
        return found

    def _must_refuse(self, kind: str) -> bool:
        return self.action == "block" or kind.startswith(PLACEHOLDER_LABEL + ":")

    def _act_on_head(self, flow: http.HTTPFlow, host: str, found) -> None:
        """Refuse (raise) or mask what was found in the URL and headers."""
        for where, finding, field in found:
            if self._must_refuse(finding.kind) or field is None:
                raise self._refusal(flow, host, f"{finding.kind} in {where}")
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
        self._record_mask(flow, [f for _, f, _ in found], ", ".join(sorted({w for w, _, _ in found})))

    def _check_body(self, flow: http.HTTPFlow):
        """A buffered request body: swap placeholders on their own hosts, then refuse or mask.
        A generator: it yields between slices, where the async driver gives the loop back."""
        host = _host(flow)
        bound = self._bound_to(host)
        raw = flow.request.raw_content
        encoding = flow.request.headers.get("content-encoding", "")
        # Only the secrets that opted in (swap = ["body"]): a placeholder of any other is
        # left as it is, and refused below.
        swapping = [s for s in bound if s.placeholder and "body" in s.swap]
        swappable = flow.request.scheme == "https" and bool(swapping)
        rewrite = self.action == "mask" or swappable
        # A placeholder of a secret swapped into the body may be in its coded bytes as sent
        # too (a stored deflate block): the body is then coded again, from what was swapped.
        sent_allowed = frozenset(s.label for s in bound) | {f"{PLACEHOLDER_LABEL}:{s.label}" for s in swapping}
        try:
            scan = self._body_scan(flow, bound, encoding, streamed=False, keep=rewrite, sent_allowed=sent_allowed,
                                   content_type=flow.request.headers.get("content-type", ""))
            findings = yield from scan.run(raw)
            body = scan.body() if rewrite else raw
            placeholders = {f.kind for f in findings if f.kind.startswith(PLACEHOLDER_LABEL + ":")}
            if swappable and placeholders:
                swapped = _swap(body, swapping)
                if swapped != body:
                    body = swapped
                    flow.request.content = body  # mitmproxy re-encodes and fixes Content-Length
                    flow_state(flow).substituted = True
                    # again: the swapped-in value may go here; a placeholder the swap could
                    # not reach (inside base64, say) may not
                    findings = yield from self._body_scan(flow, bound, "", streamed=False).run(body)
        except UndecodableBody as e:
            raise self._refusal(flow, host, f"an unreadable body (content-encoding {encoding!r}: {e})") from None
        except _OverBudget as e:
            raise self._refusal(flow, host, f"a body that could not be scanned in time ({e})") from None
        except _Elsewhere as e:
            raise self._refusal(flow, host, f"{e.kind} in the body ({e.form})") from None
        if not findings:
            return
        refused = [f for f in findings if self._must_refuse(f.kind)]
        if refused:
            raise self._refusal(flow, host, f"{refused[0].kind} in the body")
        flow.request.content = _mask(body, findings)
        self._record_mask(flow, findings, "the body")

    def _check_message(self, flow: http.HTTPFlow, message):
        """A WebSocket message (a generator, as _check_body): from the client, scanned like a
        body; from a server that was given a swapped-in secret, put back to placeholders."""
        host = _host(flow)
        try:
            if message.from_client:
                # Read with the end of the messages before it (the client's tail), as a bound
                # host's are: a finding that starts there and ends in this message is refused.
                state = flow_state(flow)
                tail = state.client_tail
                bound = self._bound_to(host)
                findings = yield from self._body_scan(flow, bound, "", streamed=False).run(message.content,
                                                                                        context=tail)
                findings = [f for f in findings if f.end > len(tail)]  # the tail's own were read before
                if findings:
                    where = "across WebSocket messages" if findings[0].start < len(tail) else "in a WebSocket message"
                    raise self._message_refusal(flow, message, host, f"{findings[0].kind} {where}")
                joined = tail + message.content if tail else message.content
                # cut at a multiple of 4 bytes from where the messages start: UTF-16/32 stays in step
                cut = max(0, len(joined) - self._client_tail)
                state.client_tail = joined[cut - cut % 4:]
            elif self._echo_due(flow, host):
                # Read with the end of the messages before it: a value split across messages
                # is one value to a command that joins them. One that starts in a message
                # already relayed cannot be put back: refused.
                state = flow_state(flow)
                tail = state.echo_tail
                scan = _BodyScan(self.echo_detector, "", frozenset(), frozenset(), self._budget(streamed=False))
                findings = yield from scan.run(message.content, context=tail)
                across = [f for f in findings if f.start < len(tail)]
                content = None if across else self._put_back(tail + message.content, findings, 0)
                if content is None:
                    where = "across WebSocket messages" if across else "in a WebSocket message"
                    raise self._message_refusal(flow, message, host,
                                                f"{(across or findings)[0].kind} given back {where}")
                if findings:
                    message.content = content[len(tail):]
                state.echo_tail = content[-self._echo_tail:]
        except _OverBudget as e:
            raise self._message_refusal(flow, message, host,
                                        f"a WebSocket message that could not be scanned in time ({e})") from None
        except _Elsewhere as e:
            given = "" if message.from_client else "given back "
            raise self._message_refusal(flow, message, host,
                                        f"{e.kind} {given}in a WebSocket message ({e.form})") from None

    def _message_refusal(self, flow, message, host: str, detail: str) -> Refused:
        message.drop()
        return self._refusal(flow, host, detail, Stage.WEBSOCKET)

    def _check_frame(self, flow: http.HTTPFlow, from_client: bool, payload: bytes) -> bool:
        """A ping, pong or close payload: False if it may not pass."""
        if from_client:
            detector, allowed, ignore = self.detector, frozenset(s.label for s in self._bound_to(_host(flow))), \
                self.ignore_kinds
            budget = self._budget(True, flow)
        elif self._echo_due(flow, _host(flow)):
            detector, allowed, ignore = self.echo_detector, frozenset(), frozenset()
            budget = self._budget(True)
        else:
            return True
        try:
            findings = list(_BodyScan(detector, "", allowed, ignore, budget).run_sync(payload))
        except _OverBudget:
            findings = [Finding("an unscannable payload", 0, len(payload))]
        except _Elsewhere as e:
            findings = [Finding(e.kind, 0, len(payload))]
        if findings:
            where = "a WebSocket control frame" if from_client else "a WebSocket control frame from the server"
            self._refuse(flow, _host(flow), f"{findings[0].kind} in {where}", Stage.WEBSOCKET)
        return not findings

    def _put_back(self, data: bytes, findings, offset: int) -> bytes | None:
        """``data`` (starting at stream offset ``offset``) with each brokered value found in it
        replaced by its placeholder in the same shape (raw or %-escaped, any case: the length
        stays); None if one is in a form that cannot be (base64, a JSON escape, compressed)."""
        if not findings:
            return data
        out, last = [], 0
        for f in findings:
            s, e = f.start - offset, f.end - offset
            secret = self.brokered.get(f.kind)
            if secret is None or s < last:
                return None
            shaped = _same_shape(data[s:e], secret.value.encode(), secret.placeholder.encode())
            if shaped is None:
                return None
            out += [data[last:s], shaped]
            last = e
        out.append(data[last:])
        return b"".join(out)

    # ---------------------------------------------------------------- outcomes

    def _refusal(self, flow: http.HTTPFlow, host: str, detail: str, stage: Stage = Stage.HEAD) -> Refused:
        """This guard's refusal (reason ``credential``, the detail naming the kind and where,
        never the value), to raise from a hook; at ``stage`` (egress.proxy.refusal.Stage):

        * HEAD: nothing has left; the client gets the documented 403 (a body still to come is
          dropped: egress.proxy.mitm.answer_before_streamed_body);
        * STREAM: a body is relayed as it is scanned; both connections are closed;
        * RESPONSE: a response to the command; killed before its body (streaming, closed);
        * WEBSOCKET: a close frame (1008) to both sides at the next frame.

        The first refusal of a flow stands, even after the flow was reported as allowed.
        """
        detail += self._placeholder_note(host, detail)
        return Refused(Decision(host, flow.request.port, False, "credential", detail=detail), stage)

    def _refuse(self, flow: http.HTTPFlow, host: str, detail: str, stage: Stage) -> None:
        """:meth:`_refusal`, carried out where no hook is there to raise it to (a stream
        function, a WebSocket frame)."""
        refused = self._refusal(flow, host, detail, stage)
        refuse(self.engine, flow, refused.decision, refused.stage)

    def _placeholder_note(self, host: str, detail: str) -> str:
        """For a placeholder refused on its own host: where that secret is swapped in, so the
        refusal says how to fix a request that put it elsewhere."""
        if not detail.startswith(PLACEHOLDER_LABEL + ":"):
            return ""
        label = detail[len(PLACEHOLDER_LABEL) + 1:].split(" ", 1)[0]
        secret = self.brokered.get(label)
        if secret is None or secret not in self._bound_to(host):
            return ""
        places = [f"the {where}" for where in secret.swap if where != "header"]
        if "header" in secret.swap:
            places.insert(0, f"the {', '.join(secret.headers)} header{'s' if len(secret.headers) > 1 else ''}")
        where = ", ".join(places[:-1]) + " and " + places[-1] if len(places) > 1 else (places or ["no place"])[0]
        return f" ({label} is swapped in {where} only; its [[credentials.secret]] swap = [...] adds others)"

    def _record_mask(self, flow: http.HTTPFlow, findings, where: str) -> None:
        kinds = ", ".join(sorted({f.kind for f in findings}))
        flow_state(flow).masked = f"{kinds} in {where}"
        self.engine.recorder.metrics.requests.labels("mask", "credential").inc()


# ------------------------------------------------------------------ the scanner


class _OverBudget(Exception):
    pass


class _Bucket:
    """Scan time one client address may spend beyond what its bytes earn (SCAN_BURST at
    most, refilled at SCAN_RATE a second), shared by its connections and requests; and the
    scan time all of them spent (the guard's own accounting)."""

    __slots__ = ("level", "burst", "rate", "stamp", "spent")

    def __init__(self, burst: float, rate: float):
        self.level, self.burst, self.rate = burst, burst, rate
        self.stamp = time.monotonic()
        self.spent = 0.0

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def take(self, seconds: float) -> bool:
        """Take ``seconds`` (the level may go below zero: a debt); False if it did."""
        self.level = self.refill() - seconds
        return self.level >= 0


class _Budget:
    """CPU time one body or message may still spend scanning (see SCAN_BURST): earned by the
    bytes it sends, then taken from its client's bucket; paid for each piece of work."""

    __slots__ = ("left", "per_byte", "cap", "bucket", "mark", "spent")

    def __init__(self, left: float, per_byte: float, cap: float, bucket: _Bucket | None = None):
        self.left, self.per_byte, self.cap, self.bucket = left, per_byte, cap, bucket
        self.mark = 0.0
        self.spent = 0.0

    def earn(self, n: int) -> None:
        self.left = min(self.cap, self.left + n * self.per_byte)

    def start(self) -> None:
        self.mark = time.thread_time()

    def charge(self) -> None:
        now = time.thread_time()
        spent, self.mark = now - self.mark, now
        self.spent += spent
        self.left -= spent
        bucket = self.bucket
        if bucket is not None:
            bucket.spent += spent
            if self.left < 0:
                debt, self.left = -self.left, 0.0
                if not bucket.take(debt):
                    raise _OverBudget(f"scan budget spent: {self.spent:.2f} s of scanning, and this client's "
                                      f"share is used up for now")
        elif self.left < 0:
            raise _OverBudget(f"scan budget spent: {self.spent:.2f} s of scanning")


class _Elsewhere(Exception):
    """A finding in another reading of a body than its decoded bytes (as sent, transcoded): it
    cannot be masked or put back in place, so the body is refused whatever the action."""

    def __init__(self, kind: str, form: str):
        super().__init__(kind, form)
        self.kind, self.form = kind, form


class _Reading:
    """One reading of a body: a StreamScanner fed in looks that take about LOOK of CPU at the
    speed the last one went (Detector.overlap new bytes at least, SCAN_BATCH at most). The
    budget is looked at after each, so text that is slow to scan is read in small looks, and
    fast text in large ones (each byte scanned ~1.06 times)."""

    __slots__ = ("scanner", "pending", "pending_len", "batch", "least")

    def __init__(self, detector: Detector):
        self.scanner = detector.stream()  # its batch is the overlap: it scans what a look hands it
        self.least = self.batch = detector.overlap  # the first look is the smallest
        self.pending: list[bytes] = []
        self.pending_len = 0

    def push(self, piece: bytes) -> None:
        """Keep ``piece`` for the next look."""
        self.pending.append(piece)
        self.pending_len += len(piece)

    @property
    def due(self) -> bool:
        """Whether a look is due (one more: a look takes ``batch`` bytes, a piece can be longer)."""
        return self.pending_len >= self.batch

    def look(self, final: bool = False) -> list[Finding]:
        """Scan the next ``batch`` bytes pushed (``final``: all of them, and settle the
        reading to its end)."""
        pending = self.pending
        if final or self.pending_len <= self.batch:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            self.pending, self.pending_len = [], 0
        else:
            take, got = [], 0
            while got < self.batch:
                piece = pending[0]
                if got + len(piece) > self.batch:  # cut it: the rest waits for the next look
                    piece, pending[0] = piece[:self.batch - got], piece[self.batch - got:]
                else:
                    del pending[0]
                take.append(piece)
                got += len(piece)
            data = take[0] if len(take) == 1 else b"".join(take)
            self.pending_len -= got
        size = self.scanner.held + len(data)
        start = time.thread_time()
        found = self.scanner.feed(data)
        if final:
            found += self.scanner.finish()
        spent = time.thread_time() - start
        # the next look: the new bytes LOOK scans at this speed, besides the ones carried
        self.batch = SCAN_BATCH if spent <= 0 else \
            min(SCAN_BATCH, max(self.least, int(size * LOOK / spent) - self.least))
        return found

    @property
    def settled(self) -> int:
        return self.scanner.settled


# Text in UTF-16 or UTF-32: a token in it is ASCII with NULs between its letters, which no
# form the detector reads has. Such a body is read transcoded to UTF-8 as well.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
TEXT_HEAD = 512  # decoded bytes looked at to tell such text: its byte-order mark, NULs, XML declaration
_CHARSET = re.compile(r"""charset\s*=\s*["']?([\w.:-]+)""", re.I)
_XML_ENCODING = re.compile(rb"""<\?xml[^>]{0,200}?encoding\s*=\s*["']([\w.:-]+)""", re.I)


def _charset(content_type: str) -> str | None:
    found = _CHARSET.search(content_type) if content_type else None
    return found.group(1) if found else None


def _wide(name: str | None) -> str | None:
    """``name``'s codec if it is UTF-16 or UTF-32 (utf-16, utf-16-le, ...), else None."""
    try:
        codec = codecs.lookup(name).name if name else None
    except LookupError:
        return None
    return codec if codec and codec.startswith(("utf-16", "utf-32")) else None


def _nuls(head: bytes) -> str | None:
    """The wide encoding ``head`` has the NULs of, as text mostly of ASCII (or Latin-1): in
    UTF-16LE every odd byte, in UTF-32LE three bytes of four (BE: mirrored). None if no such
    pattern holds (binary data with many NULs has them everywhere)."""
    n = len(head) // 4
    if n < 2:
        return None
    z = [head[i:4 * n:4].count(0) for i in range(4)]
    if z[2] + z[3] >= 1.8 * n and z[1] >= n / 2 and z[0] <= n / 4:
        return "utf-32-le"
    if z[0] + z[1] >= 1.8 * n and z[2] >= n / 2 and z[3] <= n / 4:
        return "utf-32-be"
    odd, even = z[1] + z[3], z[0] + z[2]
    if odd >= 2 * n / 3 and even <= odd / 4:
        return "utf-16-le"
    if even >= 2 * n / 3 and odd <= even / 4:
        return "utf-16-be"
    return None


def _wide_codecs(head: bytes, declared: str | None) -> tuple[str, ...]:
    """The codecs a body starting with ``head`` is read in as well: the one its byte-order mark
    names; else the one its charset parameter or XML declaration names, in the byte order its
    NULs show (both orders when they show none); else the one its NULs show; else none."""
    for bom, codec in _BOMS:
        if head.startswith(bom):
            return (codec,)
    guess = _nuls(head)
    xml = _XML_ENCODING.search(head.replace(b"\0", b""))
    for codec in (_wide(declared), _wide(xml.group(1).decode("ascii")) if xml else None):
        if codec in ("utf-16", "utf-32"):  # no order named: the NULs', or both
            return (guess,) if guess is not None and guess.startswith(codec) else (codec + "-le", codec + "-be")
        if codec is not None:
            return (codec,)
    return (guess,) if guess is not None else ()


class _Transcoded:
    """One wide encoding of a body's decoded bytes, transcoded to UTF-8 piece by piece (an odd
    byte at a piece's end waits for the next) and read as that."""

    __slots__ = ("decoder", "reading", "form", "fed", "out", "marks", "done")

    def __init__(self, detector: Detector, codec: str):
        self.decoder = codecs.getincrementaldecoder(codec)("replace")
        self.reading = _Reading(detector)
        self.form = "read as " + codec.upper().replace("-LE", "LE").replace("-BE", "BE")
        self.fed = self.out = 0  # decoded bytes fed, UTF-8 bytes made
        self.marks: deque[tuple[int, int]] = deque()  # (decoded bytes consumed, UTF-8 end) after each piece
        self.done = 0  # decoded bytes whose UTF-8 has all been settled

    def push(self, piece: bytes, final: bool = False) -> None:
        text = self.decoder.decode(piece, final).encode("utf-8", "surrogatepass")
        self.fed += len(piece)
        self.out += len(text)
        self.marks.append((self.fed - len(self.decoder.getstate()[0]), self.out))
        if text:
            self.reading.push(text)

    @property
    def settled(self) -> int:
        settled = self.reading.settled
        while self.marks and self.marks[0][1] <= settled:
            self.done = self.marks.popleft()[0]
        return self.done


class _Text:
    """A body's decoded bytes read as UTF-16/32 text too, when they are such text
    (:func:`_wide_codecs`, decided on the first TEXT_HEAD bytes): until then nothing of the
    body is settled; a body that is not such text is read no further here."""

    __slots__ = ("detector", "declared", "head", "readers")

    def __init__(self, detector: Detector, declared: str | None):
        self.detector, self.declared = detector, declared
        self.head = b""
        self.readers: list[_Transcoded] | None = None  # None: undecided

    @property
    def wide(self) -> bool | None:
        """Whether the body is read as such text (None: not decided yet)."""
        return None if self.readers is None else bool(self.readers)

    def push(self, piece: bytes) -> list[_Transcoded]:
        """Read ``piece``; the readers (their looks may be due)."""
        if self.readers is None:
            self.head += piece
            if len(self.head) < TEXT_HEAD:
                return []
            piece = self._decide()
        for reader in self.readers:
            reader.push(piece)
        return self.readers

    def finish(self) -> list[_Transcoded]:
        """The body's end: the readers, every one due for its last look."""
        piece = self._decide() if self.readers is None else b""
        for reader in self.readers:
            reader.push(piece, final=True)
        return self.readers

    def _decide(self) -> bytes:
        codecs_ = _wide_codecs(self.head[:TEXT_HEAD], self.declared)
        self.readers = [_Transcoded(self.detector, c) for c in codecs_]
        head, self.head = self.head, b""
        return head

    @property
    def settled(self) -> int:
        """How far the decoded body is settled in every transcoded reading."""
        if self.readers is None:
            return 0
        return min((r.settled for r in self.readers), default=1 << 62)


# How a reading of a body other than its decoded bytes is named in a refusal.
_AS_SENT = "in its coded bytes as sent"


class _BodyScan:
    """The one scanner behind every body path: the content coding undone piece by piece
    (ContentDecoder, BODY_SCAN_LIMIT), each piece read (a _Reading) in looks whose time is paid
    for from the budget; findings of the secrets this host may have, or of ignored kinds, dropped.

    A body is read as every receiver could read it. A coded body is read as sent too: gzip's
    name, comment and extra fields, zstd's skippable frames and brotli's metadata are bytes a
    decoder skips and anyone can read. A body of UTF-16 or UTF-32 text (_Text) is read
    transcoded too. A finding in those readings raises _Elsewhere: it cannot be masked or put
    back in place.

    :attr:`releasable` is how far the body *as sent* may be relayed: bytes whose decoded
    form has all been read and settled (for a coded body, whole chunks: a client could
    decode no more from them than our decoder did).
    """

    def __init__(self, detector: Detector, encoding: str, allowed: frozenset, ignore: frozenset,
                 budget: _Budget, keep: bool = False, *, content_type: str = "",
                 sent_allowed: frozenset | None = None, as_sent: bool = True, text: bool = True):
        decoder = ContentDecoder(encoding, BODY_SCAN_LIMIT, SLICE)  # raises for an unknown coding
        self.decoder = None if decoder.identity else decoder
        self.reading = _Reading(detector)
        self.sent = _Reading(detector) if self.decoder is not None and as_sent else None
        self.text = _Text(detector, _charset(content_type)) if text else None
        self.allowed, self.ignore = allowed, ignore
        self.sent_allowed = allowed if sent_allowed is None else sent_allowed
        self.budget = budget
        self.raw = 0  # bytes as sent, fed so far
        self.marks: deque[tuple[int, int]] = deque()  # (raw end, decoded end) of each chunk not yet releasable
        self.released = 0
        self.kept: list[bytes] | None = [] if keep else None

    # Feeding is a generator of slices: run() for the generator (the caller may yield to the
    # event loop between slices), feed()/finish() for a stream function, run_sync() for both.

    def run(self, data: bytes, context: bytes = b""):
        """Scan a whole body; a generator that yields between slices and returns the findings.
        ``context``: bytes before the body (the end of earlier messages), read with it as it
        is decoded (findings are offsets from the context's start), not as text."""
        if context:
            self.reading.push(context)
        found = yield from self.steps(data)
        found += yield from self.steps(None)
        return found

    def run_sync(self, data: bytes) -> list[Finding]:
        return _exhaust(self.run(data))

    def feed(self, chunk: bytes) -> list[Finding]:
        return _exhaust(self.steps(chunk))

    def finish(self) -> list[Finding]:
        return _exhaust(self.steps(None))

    def steps(self, data: bytes | None):
        """The work of one chunk as sent (None: the body's end): a generator that pays the
        budget for each look and each decoded piece and yields after it; returns the findings."""
        budget = self.budget
        if data is not None:
            self.raw += len(data)
            budget.earn(len(data))
            if self.decoder is None and self.text is None and \
                    self.reading.pending_len + len(data) < self.reading.batch:
                # a small chunk only kept for the next look: no work to pay for (a client
                # sending a byte at a time must not drain its budget on bookkeeping)
                self.reading.push(data)
                if self.kept is not None:
                    self.kept.append(data)
                return []
        budget.start()
        work = self._work(data)
        while True:
            try:
                next(work)
            except StopIteration as stop:
                budget.charge()
                return stop.value
            budget.charge()
            yield
            budget.start()

    def _work(self, data: bytes | None):
        """steps() without the paying: it yields before each look and before decoding each
        next piece, the units of work (the caller may stop there, or give the loop back)."""
        end = data is None
        sent = self.sent
        if sent is not None:
            if not end:
                sent.push(data)
            while sent.due:
                yield
                self._elsewhere(sent.look(), self.sent_allowed, _AS_SENT)
            if end:
                yield
                self._elsewhere(sent.look(True), self.sent_allowed, _AS_SENT)
        decoder, reading, text, kept = self.decoder, self.reading, self.text, self.kept
        if decoder is not None:
            pieces = decoder.finish() if end else decoder.feed(data)
        else:
            pieces = () if end else (data,) if len(data) <= SLICE else \
                [data[k:k + SLICE] for k in range(0, len(data), SLICE)]
        found: list[Finding] = []
        for piece in pieces:  # decoding happens as this loop asks for the next piece
            if kept is not None:
                kept.append(piece)
            if text is not None:
                for reader in text.push(piece):
                    while reader.reading.due:
                        yield
                        self._elsewhere(reader.reading.look(), self.allowed, reader.form)
                if text.wide is False:
                    text = self.text = None  # not such text: nothing more to read that way
            reading.push(piece)
            while reading.due:
                yield
                found += reading.look()
            if decoder is not None:
                yield
        if end:
            for reader in text.finish() if text is not None else ():
                while reader.reading.due:
                    yield
                    self._elsewhere(reader.reading.look(), self.allowed, reader.form)
                yield
                self._elsewhere(reader.reading.look(True), self.allowed, reader.form)
            self.text = None
            while reading.due:
                yield
                found += reading.look()
            yield
            found += reading.look(True)
            self.marks.clear()
            self.released = self.raw
        elif decoder is not None:
            self.marks.append((self.raw, decoder.size))
        if found:
            found = [f for f in found if f.kind not in self.allowed and f.kind not in self.ignore]
        return found

    def _elsewhere(self, found: list[Finding], allowed: frozenset, form: str) -> None:
        for finding in found:
            if finding.kind not in allowed and finding.kind not in self.ignore:
                raise _Elsewhere(finding.kind, form)

    @property
    def releasable(self) -> int:
        settled = self.reading.settled
        if self.text is not None:
            settled = min(settled, self.text.settled)
        if self.decoder is None:
            return settled
        while self.marks and self.marks[0][1] <= settled:
            self.released = self.marks.popleft()[0]
        return self.released if self.sent is None else min(self.released, self.sent.settled)

    def body(self) -> bytes:
        """The decoded body (kept only when asked for: to rewrite it)."""
        return b"".join(self.kept)


def _exhaust(steps):
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


async def _drive(work) -> None:
    """Run a scanning generator, giving the event loop back between slices: other clients
    are served while a large body is scanned."""
    for _ in work:
        await asyncio.sleep(0)


class _Relay:
    """A mitmproxy stream function: relays a body as far as it has been scanned.

    Uploads: a finding ends the request. Responses to a request that carried a swapped-in
    secret (``echo``): a brokered value is put back to its placeholder in place if it can
    be (same length: the Content-Length has been sent), else the response is cut off.

    mitmproxy calls it synchronously for each read, while every other client waits. A call
    scans for STREAM_CALL of CPU at most; what it leaves is scanned between reads (a task,
    LOOK at a time, the loop given back in between) while mitmproxy reads nothing more of
    this connection (its event lock held): the client waits for its own scanning, no one
    else does. The body's end cannot wait: its call may take STREAM_END, and a body whose
    last read needs more is cut off.

    Nothing to relay yet is an empty list, never b"": mitmproxy sends an empty chunk of a
    chunked body as "0\r\n\r\n", the end of the body, and what follows would reach the
    upstream as a request of its own.
    """

    def __init__(self, guard: CredentialGuard, flow: http.HTTPFlow, host: str, scan: _BodyScan, echo: bool = False,
                 also: list | None = None):
        self.guard, self.flow, self.host, self.scan, self.echo = guard, flow, host, scan, echo
        self.also = also or []  # other readings of the same bytes (_Sniffed): a finding there is cut off
        # The chunks not relayed yet, as they came: a list, not one bytes grown by +=, which
        # copied everything held (up to SCAN_BATCH + overlap) for every chunk and again to cut
        # off what was relayed -- 3.9% of the proxy's samples in an 8 MiB upload (py-spy).
        self.held: list[bytes] = []
        self.held_len = 0
        self.offset = 0  # stream offset of the first held byte
        self.stopped = False
        self.queue: deque[bytes | None] = deque()  # chunks not scanned yet (None: the end)
        self.queued = 0  # their bytes
        self.work = None  # the scan's steps through the chunk under way
        self.task: asyncio.Task | None = None  # the scanning between reads

    @property
    def where(self) -> str:
        return "the response body" if self.echo else "the body"

    def __call__(self, chunk: bytes) -> bytes | list:
        if self.stopped or self.scan is None:
            return []
        if chunk:
            self.held.append(chunk)
            self.held_len += len(chunk)
            self.queued += len(chunk)
        self.queue.append(chunk or None)
        for side in self.also:
            try:
                other = side.feed(chunk) if chunk else side.finish()
            except UndecodableBody as e:
                return self._stop(f"a response that cannot be read ({e})")
            except _OverBudget as e:
                return self._stop(f"{self.where} could not be scanned in time ({e})")
            if other:
                return self._stop(f"{other[0].kind} given back in {self.where} ({side.form})")
        if not self._advance(STREAM_END if not chunk else STREAM_CALL):
            if not chunk:
                return self._stop(f"{self.where} could not be scanned in time (its end came with more than "
                                  f"{STREAM_END * 1000:.0f} ms of scanning left)")
            if self.queued > STREAM_QUEUE:  # nothing holds the client back (no event lock here)
                return self._stop(f"{self.where} could not be scanned in time (sent faster than it could be)")
            self._later()
        if self.stopped:
            return []
        if not chunk:  # the end: all of it is scanned
            out = self._release(self.held_len)
            self.drop()
            return out
        releasable = self.scan.releasable
        for side in self.also:
            releasable = min(releasable, side.releasable)
        return self._release(releasable - self.offset)

    def _advance(self, limit: float) -> bool:
        """Scan the queued chunks for ``limit`` of CPU at most: True when none is left."""
        until = time.thread_time() + limit
        while not self.stopped:
            if self.work is None:
                if not self.queue:
                    return True
                chunk = self.queue.popleft()
                if chunk is not None:
                    self.queued -= len(chunk)
                self.work = self.scan.steps(chunk)
            try:
                next(self.work)
            except StopIteration as stop:
                self.work = None
                if stop.value:
                    self._found(stop.value)
                continue
            except UndecodableBody as e:
                self._stop(f"an unreadable body ({e})" if not self.echo else f"a response that cannot be read ({e})")
            except _OverBudget as e:
                self._stop(f"{self.where} could not be scanned in time ({e})")
            except _Elsewhere as e:
                self._stop(f"{e.kind} {'given back ' if self.echo else ''}in {self.where} ({e.form})")
            if time.thread_time() >= until:
                return False
        return True

    def _found(self, findings: list[Finding]) -> None:
        if not self.echo or self.scan.decoder is not None:
            self._stop(f"{findings[0].kind} {'given back ' if self.echo else ''}in {self.where}")
            return
        put_back = self.guard._put_back(b"".join(self.held), findings, self.offset)
        if put_back is None:
            self._stop(f"{findings[0].kind} given back in {self.where}")
        else:
            self.held = [put_back]

    def _later(self) -> None:
        """Go on scanning between reads (not when driven by hand, outside an event loop)."""
        if self.task is None:
            try:
                self.task = asyncio.get_running_loop().create_task(self._between_reads())
            except RuntimeError:
                pass

    async def _between_reads(self) -> None:
        lock = mitm.event_lock(self.flow)
        try:
            async with lock if lock is not None else contextlib.nullcontext():
                while self.scan is not None and not self._advance(LOOK):
                    await asyncio.sleep(0)  # other clients' turn
        finally:
            self.task = None

    def _release(self, upto: int) -> bytes | list:
        """The first ``upto`` held bytes, taken off the held chunks ([] for none)."""
        if upto <= 0:
            return []
        held = self.held
        if upto >= self.held_len:
            if not held:
                return []
            out = held[0] if len(held) == 1 else b"".join(held)
            self.held = []
        else:
            k, n = 0, 0
            while n + len(held[k]) <= upto:
                n += len(held[k])
                k += 1
            cut = upto - n  # within held[k]
            parts = held[:k]
            if cut:
                parts.append(held[k][:cut])
                held[k] = held[k][cut:]
            del held[:k]
            out = parts[0] if len(parts) == 1 else b"".join(parts)
        self.held_len -= len(out)
        self.offset += len(out)
        return out

    def _stop(self, detail: str) -> list:
        self.stopped = True
        self.held, self.held_len = [], 0
        self.drop()
        self.guard._refuse(self.flow, self.host, detail, Stage.STREAM)
        return []

    def drop(self) -> None:
        """The body is done with (ended, refused, or its flow failed): let its decoder (a zstd
        window can be 8 MiB) and scanners go now, not when the collector finds the flow."""
        for scan in (self.scan, *(getattr(side, "scan", None) for side in self.also)):
            if isinstance(scan, _BodyScan) and scan.decoder is not None:
                scan.decoder.close()
        self.scan, self.also, self.work = None, [], None
        self.queue.clear()
        self.queued = 0
        task, self.task = self.task, None
        if task is not None and task is not _current_task():
            task.cancel()


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop running
        return None


# What the first bytes of a compressed body are, whatever its headers say.
_GZIP_MAGIC, _ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


def _sniff(head: bytes) -> str | None:
    """The content coding ``head`` starts like (gzip, zlib as "deflate", zstd), or None."""
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_ZSTD_MAGIC):
        return "zstd"
    if len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        return "deflate"
    return None


class _Sniffed:
    """An unlabelled response body that starts like gzip, zlib or zstd, decoded as that:
    a client can decode what its headers do not label. Until its first bytes have come
    nothing is releasable. A body that does not start so, or does not decode from its
    first bytes (text that only looks like a zlib header), is left to the plain reading;
    one that decodes and then breaks (garbage after the stream, cut short) or passes
    BODY_SCAN_LIMIT decoded is cut off, as a labelled body is."""

    form = "compressed, whatever its headers say"
    _DONE = object()

    def __init__(self, detector: Detector, budget):
        self.detector, self.budget = detector, budget
        self.head = b""
        self.coding: str | None = None
        self.scan = None  # None: undecided; _DONE: nothing more to read; else the decoding scan

    def feed(self, chunk: bytes) -> list[Finding]:
        if self.scan is None:
            self.head += chunk
            if len(self.head) < len(_ZSTD_MAGIC):
                return []
            self.coding, chunk, self.head = _sniff(self.head), self.head, b""
            self.scan = self._DONE if self.coding is None else \
                _BodyScan(self.detector, self.coding, frozenset(), frozenset(), self.budget(), as_sent=False,
                          text=False)
        if self.scan is self._DONE:
            return []
        try:
            return self.scan.feed(chunk)
        except UndecodableBody as e:
            return self._stopped(e)

    def finish(self) -> list[Finding]:
        if self.scan is None or self.scan is self._DONE:
            self.scan = self._DONE  # under 4 bytes: no secret fits
            return []
        try:
            return self.scan.finish()
        except UndecodableBody as e:
            return self._stopped(e)

    def _stopped(self, error: UndecodableBody) -> list[Finding]:
        """Decoding failed. Before any output: it was not compressed, the plain reading is
        enough (not so for a zstd window over the limit: valid zstd, which a lenient client decodes). After some: what decoded may not all have been scanned yet (the scanner works
        in batches), and a client can decode it all the same: raised, the response cut off."""
        if self.scan.decoder.size == 0 and not isinstance(error, WindowTooLarge):
            self.scan = self._DONE
            return []
        raise UndecodableBody(f"it starts like {self.coding} and does not decode: {error}")

    @property
    def releasable(self) -> int:
        if self.scan is None:
            return 0
        if self.scan is self._DONE:
            return 1 << 62
        return self.scan.releasable


def _guard_frames(checker: CredentialGuard, flow: http.HTTPFlow, from_client: bool, events):
    """``events`` of one side's wsproto connection, with its ping, pong and close payloads
    checked, and a close (1008, policy violation) put in when a refusal asks for one
    (FlowState.websocket_close, set by egress.proxy.refusal at Stage.WEBSOCKET)."""
    state = flow_state(flow)

    def guarded():
        for event in events():
            if state.websocket_close:
                break
            payload = None
            if isinstance(event, (wsproto.events.Ping, wsproto.events.Pong)):
                payload = bytes(event.payload)
            elif isinstance(event, wsproto.events.CloseConnection):
                payload = (event.reason or "").encode()
            if payload and not checker._check_frame(flow, from_client, payload):
                break
            yield event
            if state.websocket_close:  # set by websocket_message while this event was out
                break
        if state.websocket_close:
            yield wsproto.events.CloseConnection(1008, "egress: refused (credential)")
    return guarded


# ------------------------------------------------------------------ helpers


def _host(flow: http.HTTPFlow) -> str:
    return flow_state(flow).host_name or flow.request.host


def _forms(fake: str, real: str):
    """A placeholder and its value as they appear raw, percent-encoded and JSON-escaped."""
    yield fake, real
    quoted = urllib.parse.quote(fake, safe="")
    if quoted != fake:
        yield quoted, urllib.parse.quote(real, safe="")
    escaped = json.dumps(fake)[1:-1]
    if escaped != fake:
        yield escaped, json.dumps(real)[1:-1]


def _swap(data: bytes, bound: list[StoredSecret]) -> bytes:
    for secret in bound:
        if secret.placeholder:
            data = data.replace(secret.placeholder.encode(), secret.value.encode())
    return data


def _decode_basic(value: bytes) -> bytes | None:
    try:
        return base64.b64decode(value[6:].strip(), validate=True)
    except ValueError:
        return None


def _swap_basic(value: bytes, brokered: list[StoredSecret]) -> bytes:
    decoded = _decode_basic(value)
    if decoded is None:
        return value
    swapped = decoded
    for secret in brokered:
        swapped = swapped.replace(secret.placeholder.encode(), secret.value.encode())
    return value if swapped == decoded else b"Basic " + base64.b64encode(swapped)


_HEX = b"0123456789abcdefABCDEF"


def _same_shape(text: bytes, real: bytes, fake: bytes) -> bytes | None:
    """``text`` -- ``real`` as found: its bytes raw or %XX-escaped one by one, in any case --
    with each byte replaced by ``fake``'s byte at the same place, escaped the same way: the
    same length, and it decodes to ``fake``. None if ``text`` is not such a form of ``real``."""
    out = bytearray()
    i = k = 0
    while i < len(text) and k < len(real):
        if text[i] == 0x25 and i + 2 < len(text) and text[i + 1] in _HEX and text[i + 2] in _HEX:
            b, escaped, i = int(text[i + 1:i + 3], 16), True, i + 3
        else:
            b, escaped, i = text[i], False, i + 1
        if bytes([b]).lower() != real[k:k + 1].lower():
            return None
        out += b"%%%02X" % fake[k] if escaped else fake[k:k + 1]
        k += 1
    return bytes(out) if i == len(text) and k == len(real) else None


def _mask(data: bytes, findings) -> bytes:
    out, last = [], 0
    for finding in sorted(findings, key=lambda f: f.start):
        out.append(data[last:finding.start])
        out.append(f"[redacted:{finding.kind}]".encode())
        last = finding.end
    out.append(data[last:])
    return b"".join(out)
