"""How fast the credential detector scans, and how much the literal prefilter buys.

Run:  /work/venv/bin/python bench/scanner_bench.py [--size 16] [--repeat 5] [--quick]

Three synthetic data sets of ``--size`` MiB each, made from a fixed seed:

* clean: a mix of JSON API objects (UUIDs, git SHAs, sha256 digests, ETags, URLs,
  some with ``\\/`` escapes and percent-encoded queries), English-like prose, access-log
  lines and base64 blobs (images) -- no credentials;
* near-miss: the same kind of text, dense with prefixes that are not tokens -- ``ghp_``,
  ``sk-``, ``sk-ant-``, ``AKIA``, ``eyJ``, ``xoxb-``, ``glpat-``, ``npm_``, ``AIza``,
  ``hf_``, ``-----BEGIN``, ``://user:@``, ``Basic`` -- followed by a wrong length or
  alphabet, one every ~40 bytes;
* tokens: the clean mix with a real-format (made-up) token every 4 KiB, rotating
  through the formats, some raw, some percent-encoded, some in base64 Basic auth;
* and the clean set again with a Detector holding 20 stored secrets (16-60 characters),
  what an install with secret-named environment variables carries.

For each it reports MB/s (MiB of input per second, best of ``--repeat``) of:

* ``scan``: ``Detector().scan(data)`` -- what the proxy does with a body;
* ``stream``: a StreamScanner fed 64 KiB chunks (carrying ``overlap`` bytes each time);
* ``raw``: the prefilter and rules on the raw bytes only, no encoded layers -- the
  like-for-like comparison with the naive approach;
* ``1-regex``: the prefilter as one compiled alternation of the escaped literal anchors
  (longest first; the few non-literal ones left out), same checks at each hit, no layers;
* ``per-prefix``: the other prefilter the issue names -- one literal-led search per
  anchor (~100 passes) instead of one per lead character, same checks, no layers;
* ``naive``: every rule's full regex run over the whole buffer one after another (the
  same rules and checks, no prefilter, no layers), measured once;

and the ratios raw/naive and scan/naive, plus how many findings each produced (clean
and near-miss must be 0; tokens must find every planted token). Progress goes to
stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import random
import re
import string
import sys
import time
import urllib.parse
from functools import partial

sys.path.insert(0, os.environ.get("EGRESS_BENCH_SRC") or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from egress.scan import detect  # noqa: E402
from egress.scan.detect import Detector  # noqa: E402

WORDS = ("the of and to in is you that it was for on are as with they at be this have from or one had by word but "
         "not what all were we when your can said there use an each which she do how their if will up other about "
         "out many then them these so some her would make like him into time has look two more write go see number "
         "no way could people request response server client token session header content value error status "
         "config default version key secret").split()
B62 = string.ascii_letters + string.digits
B64U = B62 + "_-"
HEX = "0123456789abcdef"


def _uuid(r: random.Random) -> str:
    h = f"{r.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def clean_piece(r: random.Random) -> str:
    k = r.random()
    if k < 0.45:
        obj = {"id": _uuid(r), "sha": f"{r.getrandbits(160):040x}", "digest": f"sha256:{r.getrandbits(256):064x}",
               "url": f"https://api.example.com/v1/items/{r.randrange(10**6)}?page={r.randrange(9)}&per_page=50",
               "name": " ".join(r.choice(WORDS) for _ in range(5)), "count": r.randrange(10**9),
               "created_at": f"2026-01-{r.randrange(1, 29):02d}T10:{r.randrange(60):02d}:00Z",
               "etag": f'W/"{r.getrandbits(128):032x}"', "enabled": r.random() < .5,
               "description": " ".join(r.choice(WORDS) for _ in range(25))}
        s = json.dumps(obj)
        return (s.replace("/", "\\/") if r.random() < 0.3 else s) + "\n"
    if k < 0.75:
        return " ".join(r.choice(WORDS) for _ in range(60)).capitalize() + ".\n"
    if k < 0.93:
        q = "%20".join(r.choice(WORDS) for _ in range(3))
        return (f"2026-03-04T12:{r.randrange(60):02d}:00Z INFO [{_uuid(r)}] GET /api/v2/users/{r.randrange(10**5)}"
                f"/repos?sort=updated&q={q} 200 {r.randrange(900)}ms ua=Mozilla/5.0 (X11; Linux x86_64)\n")
    blob = base64.b64encode(b"\x89PNG\r\n\x1a\n" + r.randbytes(r.randrange(200, 3000))).decode()
    return '{"avatar": "data:image/png;base64,' + blob + '"}\n'


COMPOSITION: dict[str, int] = {}  # bytes of each kind of piece in the clean set


def _kind(piece: str) -> str:
    return ("base64" if "base64," in piece else "JSON" if piece.startswith('{"id"') else
            "log" if " INFO [" in piece else "prose")


def build(size: int, piece, seed: int) -> bytes:
    r = random.Random(seed)
    parts, n = [], 0
    while n < size:
        p = piece(r)
        parts.append(p)
        n += len(p)
        if piece is clean_piece:
            COMPOSITION[_kind(p)] = COMPOSITION.get(_kind(p), 0) + len(p)
    return "".join(parts).encode()[:size]


def near_miss_piece(r: random.Random) -> str:
    def rnd(n, alphabet=B62):
        return "".join(r.choice(alphabet) for _ in range(n))
    misses = [
        lambda: "ghp_" + rnd(r.choice([10, 30, 35, 37, 50])),
        lambda: "gho_" + rnd(36, string.ascii_lowercase + "-"),
        lambda: "sk-" + rnd(r.choice([8, 20, 48])),
        lambda: "sk-ant-api03-" + rnd(40, B64U),
        lambda: "AKIA" + rnd(r.choice([8, 15, 17]), string.ascii_uppercase),
        lambda: "AKIA" + rnd(16, string.ascii_lowercase),
        lambda: "eyJ" + rnd(30, B64U) + "." + rnd(5),
        lambda: "xoxb-" + rnd(10, string.digits) + "-" + rnd(5),
        lambda: "glpat-" + rnd(r.choice([5, 12, 19])),
        lambda: "npm_" + rnd(r.choice([20, 40])),
        lambda: "AIza" + rnd(20, B64U),
        lambda: "hf_" + rnd(34, string.digits),
        lambda: "-----BEGIN CERTIFICATE-----",
        lambda: "https://user:@" + rnd(8, string.ascii_lowercase) + ".example",
        lambda: "Basic " + rnd(6),
        lambda: "sk_test_" + rnd(24),
        lambda: "pk_live_" + rnd(24),
        lambda: "dapi" + rnd(20, HEX),
        lambda: rnd(9, string.digits) + ":" + rnd(10),
    ]
    return " ".join(r.choice(WORDS) for _ in range(3)) + " " + r.choice(misses)() + ("\n" if r.random() < .2 else " ")


TOKEN_MAKERS = [
    lambda r: "ghp_" + "".join(r.choice(B62) for _ in range(36)),
    lambda r: "AKIA" + "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(16)),
    lambda r: "sk-ant-api03-" + "".join(r.choice(B64U) for _ in range(93)) + "AA",
    lambda r: (f"xoxb-{r.randrange(10**11, 10**12)}-{r.randrange(10**12, 10**13)}-"
               + "".join(r.choice(B62) for _ in range(24))),
    lambda r: "glpat-" + "".join(r.choice(B64U) for _ in range(20)),
    lambda r: "npm_" + "".join(r.choice(B62) for _ in range(36)),
    lambda r: "sk_live_" + "".join(r.choice(B62) for _ in range(99)),
    lambda r: "AIzaSy" + "".join(r.choice(B64U) for _ in range(33)),
]


def tokens_data(size: int, seed: int) -> tuple[bytes, int]:
    r = random.Random(seed)
    clean = build(size, clean_piece, seed + 1)
    parts, planted = [], 0
    for i in range(0, len(clean), 4096):
        parts.append(clean[i:i + 4096])
        token = TOKEN_MAKERS[planted % len(TOKEN_MAKERS)](r)
        form = planted % 3
        if form == 0:
            parts.append(f" {token} ".encode())
        elif form == 1:
            parts.append(f" q=1&t={urllib.parse.quote(token, safe='')}&x=2 ".encode())
        else:
            parts.append(b" Authorization: Basic " + base64.b64encode(f"x-access-token:{token}".encode()) + b" ")
        planted += 1
    return b"".join(parts), planted


def naive_scan(data: bytes) -> int:
    """Every rule's full regex over the whole buffer, one rule after another."""
    found = 0
    for _kind, _anchors, pattern, _offsets, _group, check, *_rest in detect._TABLE:
        if pattern is None:  # PEM / PuTTY: their header patterns
            for m in detect._PEM_HEADER.finditer(data):
                found += detect._pem_match(data, m.start()) is not None
            continue
        for m in pattern.finditer(data):
            if check is None or check(m):
                found += 1
    return found


def per_prefix_scan(data: bytes) -> int:
    """One literal-led search per anchor (~100 passes) instead of one per lead character,
    the same rule checks at each hit; no layers."""
    det = Detector()
    found: list = []
    for anchor, actions in zip(detect._STATIC_ANCHORS, detect._STATIC_ACTIONS, strict=True):
        (regex, _, before, _), = detect._compile_passes([anchor])
        for m in regex.finditer(data):
            for action in actions:
                if type(action) is detect._Rule:
                    det._apply(action, data, m.start() - before[0], found)
    return len(found)


def _alternation():
    """One regex: the alternation of every literal anchor, escaped, longest first (the
    eight anchors that are not literal -- Discord, Telegram, JWT, ... -- are left out).
    No capture groups (they would stop the engine's first-character check); the matched
    text says which anchor it was."""
    by_text = {}
    for i, a in enumerate(detect._STATIC_ANCHORS):
        text = a.before + re.escape(a.lead) + a.after
        literal = re.sub(rb"\\(.)", rb"\1", text)
        if re.escape(literal) == text:
            by_text.setdefault(literal, (i, a.before_len))
    order = sorted(by_text, key=len, reverse=True)
    return re.compile(b"|".join(re.escape(t) for t in order)), by_text


ALTERNATION, ALT_ANCHORS = _alternation()


def alternation_scan(data: bytes) -> int:
    """The prefilter as one alternation of the escaped literal anchors (what the issue
    suggests first), the same rule checks at each hit; no layers."""
    det = Detector()
    found: list = []
    for m in ALTERNATION.finditer(data):
        i, _ = ALT_ANCHORS[m.group()]
        for action in detect._STATIC_ACTIONS[i]:
            if type(action) is detect._Rule:
                det._apply(action, data, m.start(), found)
    return len(found)


def best_of(n: int, fn) -> tuple[float, object]:
    """Best of n, in CPU seconds of this process (time.process_time): MB/s per core, which
    holds up when other work shares the machine (wall time did not)."""
    best, result = float("inf"), None
    for _ in range(n):
        t = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t)
    return best, result


def stream_scan(det: Detector, data: bytes, chunk: int = 65536, batch: int | None = None) -> list:
    scanner = det.stream() if batch is None else det.stream(batch)
    found = []
    for i in range(0, len(data), chunk):
        found += scanner.feed(data[i:i + chunk])
    return found + scanner.finish()


# ------------------------------------------------------------------ wedging (--wedge)

# Text dense with prefixes that are no token: what a slow legitimate body looks like.
NEAR_MISS_LINE = b" ".join([b"ghp_short", b"sk-ant-api03-x", b"AKIAlower", b"eyJnotajwt", b"xoxb-1", b"glpat-",
                            b"-----BEGIN RSA PRIVATE KEY-----", b"://user:@h", b"Basic Zm9v", b"AIza"] * 20) + b"\n"


def _cpu(fn) -> tuple[float, object]:
    t = time.thread_time()
    result = fn()
    return time.thread_time() - t, result


def wedge_cases(one_byte: int) -> list[tuple[str, int, float, str]]:
    """(case, bytes sent, CPU seconds, outcome) for the bodies that wedged the proxy, with the
    detector that is imported (this tree, or --wedge-base's revision in a subprocess)."""
    import gzip

    from egress.scan.detect import decode_content

    det = Detector()
    rows = []

    def one_bytes():
        scanner = det.stream()
        data = build(one_byte, clean_piece, 5)
        for i in range(len(data)):
            scanner.feed(data[i:i + 1])
        return scanner.finish()
    t, found = _cpu(one_bytes)
    rows.append((f"{one_byte // 1000} KB in one-byte chunks, StreamScanner", one_byte, t, f"{len(found)} found"))

    for name, text, size in (("PEM headers", b"-----BEGIN RSA PRIVATE KEY-----\n", 30_000),
                             ("near-miss text", NEAR_MISS_LINE, 110_000)):
        body = gzip.compress(text * (64 * 2**20 // len(text)), 9)[:size]  # what fits in `size` bytes of gzip
        body = gzip.compress(decode_content_prefix(body), 9)
        plain = decode_content(body, "gzip")
        t, found = _cpu(partial(det.scan, plain))
        rows.append((f"{len(body) // 1000} KB gzip of {name} ({len(plain) / 2**20:.0f} MiB decoded), Detector.scan",
                     len(body), t, f"{len(found)} found"))
    return rows


def decode_content_prefix(truncated_gzip: bytes) -> bytes:
    """What a cut gzip stream decodes to, as far as it goes."""
    import zlib
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(truncated_gzip)


def guard_cases() -> list[tuple[str, int, float, str]]:
    """The same gzip bodies through the credential guard's one body scanner, with its budget."""
    import gzip

    from egress.proxy.addons import credential_guard as cg

    rows = []
    for name, text, size in (("PEM headers", b"-----BEGIN RSA PRIVATE KEY-----\n", 30_000),
                             ("near-miss text", NEAR_MISS_LINE, 110_000)):
        body = gzip.compress(decode_content_prefix(gzip.compress(text * (64 * 2**20 // len(text)), 9)[:size]), 9)
        budget = cg._Budget(cg.SCAN_BURST, cg.SCAN_PER_BYTE, float("inf"))
        scan = cg._BodyScan(Detector(), "gzip", frozenset(), frozenset(), budget)
        t, outcome = _cpu(partial(_guard_run, cg, scan, body))
        rows.append((f"{len(body) // 1000} KB gzip of {name}, guard (budget {cg.SCAN_BURST} s + "
                     f"{cg.SCAN_PER_BYTE * 1e6:g} us/byte)", len(body), t, outcome))
    return rows


def _guard_run(cg, scan, body: bytes) -> str:
    try:
        return f"{len(scan.run_sync(body))} found"
    except cg._OverBudget as e:
        return f"refused: {e}"


def budget_rates() -> list[tuple[str, float]]:
    """us of CPU per byte scanned, for the mixes the budget must let through."""
    out = []
    for name, data in (("clean mix", build(4 * 2**20, clean_piece, 1)),
                       ("near-miss mix", build(4 * 2**20, near_miss_piece, 2)),
                       ("near-miss lines", NEAR_MISS_LINE * (4 * 2**20 // len(NEAR_MISS_LINE))),
                       ("PEM headers", b"-----BEGIN RSA PRIVATE KEY-----\n" * (4 * 2**20 // 32))):
        t, _ = best_of(3, partial(Detector().scan, data))
        out.append((name, t / len(data) * 1e6))
    return out


def wedge_main(args) -> None:
    if args.wedge_json:  # the child run for --wedge-base: print rows and leave
        print(json.dumps(wedge_cases(args.one_byte)))
        return
    print(f"# scanner_bench --wedge: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPU, "
          f"Python {platform.python_version()}; CPU seconds (thread_time), one run each")
    base = {}
    if args.wedge_base:
        import subprocess
        import tempfile
        repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "-C", repo, "archive", args.wedge_base, "egress"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            print(f"{args.wedge_base}: measuring (the old one-byte case takes a while)...", file=sys.stderr)
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--wedge", "--wedge-json",
                                    "--one-byte", str(args.one_byte)], capture_output=True, text=True, check=True,
                                   env={**os.environ, "PYTHONPATH": tmp, "EGRESS_BENCH_SRC": tmp})
            base = {row[0]: row for row in json.loads(child.stdout)}
    print(f"| case | bytes sent | {args.wedge_base or 'before'} CPU s | now CPU s | outcome now |")
    print("|---|---|---|---|---|")
    for case, n, t, outcome in wedge_cases(args.one_byte):
        old = f"{base[case][2]:.2f}" if case in base else "-"
        print(f"| {case} | {n} | {old} | {t:.3f} | {outcome} |")
    for case, n, t, outcome in guard_cases():
        print(f"| {case} | {n} | - | {t:.3f} | {outcome} |")
    print()
    print("| mix | us of CPU per byte scanned |")
    print("|---|---|")
    for name, rate in budget_rates():
        print(f"| {name} | {rate:.3f} |")


def load_base(rev: str, tmp: str):
    """egress/scan/detect.py and decode.py (and multimatch.py, where it is) at ``rev``, imported as
    the package egress_base."""
    import importlib
    import io
    import subprocess
    import tarfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    present = subprocess.run(["git", "-C", repo, "ls-tree", "--name-only", rev, "egress/"], capture_output=True,
                             text=True, check=True, timeout=60).stdout.split()
    files = [f for f in ("egress/scan/detect.py", "egress/scan/decode.py", "egress/scan/multimatch.py") if f in present]
    blob = subprocess.run(["git", "-C", repo, "archive", rev, *files], capture_output=True, check=True,
                          timeout=60).stdout
    target = os.path.join(tmp, "egress_base")
    os.makedirs(target)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            with open(os.path.join(target, os.path.basename(member.name)), "wb") as f:
                f.write(tar.extractfile(member).read())
    open(os.path.join(target, "__init__.py"), "w").close()
    sys.path.insert(0, tmp)
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", rev], capture_output=True, text=True,
                            timeout=30).stdout.strip()
    return importlib.import_module("egress_base.detect"), commit


def _side_work(work: str, det, data: bytes, batch: int | None):
    if work == "scan":
        return det.scan(data)
    if work == "stream":
        return stream_scan(det, data)
    return stream_scan(det, data, batch=batch)


def side_by_side(args, sets, repeat: int, secrets) -> None:
    """The same data through the detector at --base and this one, interleaved: scan,
    stream (64 KiB chunks) and body (64 KiB chunks as the proxy's body scanner feeds them,
    with its SCAN_BATCH where the detector has one); the stored-secrets set with both
    detectors holding ``secrets``."""
    import inspect
    import tempfile

    from egress.proxy.addons.credential_guard import SCAN_BATCH

    with tempfile.TemporaryDirectory(prefix="scanner-base-") as tmp:
        base, commit = load_base(args.base, tmp)
        batched = "batch" in inspect.signature(base.Detector.stream).parameters
        print(f"\n# side by side, CPU seconds, best of {repeat}: base = egress/scan/detect.py at {args.base} ({commit}), "
              f"this = the working tree; body = 64 KiB chunks, batch {SCAN_BATCH // 1024} KiB"
              f"{'' if batched else ' (base: no batch, its stream)'}")
        head = ("data set", "base scan MB/s", "scan MB/s", "x", "base stream", "stream", "x", "base body", "body",
                "x", "same findings")
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for name, data, _ in sets:
            if "stored" in name:
                old, new = base.Detector(secrets), Detector(secrets)
            else:
                old, new = base.Detector(), Detector()
            n = len(data) / 2**20
            cells, same = [], True
            for work in ("scan", "stream", "body"):
                t_old = t_new = float("inf")
                for _ in range(repeat):  # interleaved, so both see the same machine
                    t, f_old = best_of(1, partial(_side_work, work, old, data, SCAN_BATCH if batched else None))
                    t_old = min(t_old, t)
                    t, f_new = best_of(1, partial(_side_work, work, new, data, SCAN_BATCH))
                    t_new = min(t_new, t)
                same = same and [tuple(f) for f in f_old] == [tuple(f) for f in f_new]
                cells += [f"{n / t_old:.1f}", f"{n / t_new:.1f}", f"{t_old / t_new:.2f}x"]
            print(f"| {name} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")


def parts_main(args) -> None:
    """--parts: the steps of one Detector.scan of the clean set, each timed on its own (CPU ms
    per MiB, best of N): the compiled pass with and without the run triggers, each layer's
    segment finding and decoding, and the whole scan. What an upload through the proxy pays
    per MiB is about the whole scan (bench/README.md, "Uploads: where the gap is")."""
    from egress.scan import decode
    size = int((1 if args.quick else args.size) * 2**20)
    repeat = 2 if args.quick else args.repeat
    data = build(size, clean_piece, 1)
    det = Detector()
    with_runs, _, _ = detect._static_database(True)
    without, _, _ = detect._static_database(False)
    found = det._find(data)[1]
    steps = [
        ("compiled pass, anchors only", lambda: without.scan(data, [])),
        ("compiled pass, anchors and run triggers (what a scan makes)", lambda: with_runs.scan(data, [])),
        ("JSON escape segments, found and decoded", lambda: decode.json_segments(data)),
        ("percent segments, found and decoded", lambda: decode.percent_segments(data)),
        ("quoted-printable segments from the triggers' evidence, decoded", lambda: decode.qp_segments(data, found.qp)),
        ("base64/hex runs from the triggers' starts, decoded",
         lambda: decode.run_segments(data, found.runs, found.hexes)),
        ("the whole scan: Detector.scan", lambda: det.scan(data)),
    ]
    mib = len(data) / 2**20
    print(f"# scanner_bench --parts: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"Python {platform.python_version()}, clean set {mib:.0f} MiB, best of {repeat}")
    print("| step | CPU ms per MiB | made |")
    print("|---|---|---|")
    for name, fn in steps:
        t, made = best_of(repeat, fn)
        print(f"| {name} | {t * 1000 / mib:.2f} | {len(made)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=16, help="MiB per data set (default 16)")
    ap.add_argument("--repeat", type=int, default=5, help="best of N runs (default 5)")
    ap.add_argument("--quick", action="store_true", help="1 MiB, best of 2")
    ap.add_argument("--wedge", action="store_true", help="the bodies that wedged the proxy, and the budget's rates")
    ap.add_argument("--wedge-base", metavar="REV", help="with --wedge: also measure egress at this git revision")
    ap.add_argument("--one-byte", type=int, default=34_000, help="with --wedge: bytes fed one at a time")
    ap.add_argument("--wedge-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", metavar="REV", help="also scan with egress/scan/detect.py at this git revision, side by side")
    ap.add_argument("--parts", action="store_true", help="where a clean scan's time goes, step by step, in ms per MiB")
    args = ap.parse_args()
    if args.wedge:
        wedge_main(args)
        return
    if args.parts:
        parts_main(args)
        return
    size = int((1 if args.quick else args.size) * 2**20)
    repeat = 2 if args.quick else args.repeat

    print("building data sets...", file=sys.stderr)
    sets = [("clean", build(size, clean_piece, 1), 0),
            ("near-miss", build(size, near_miss_piece, 2), 0)]
    data, planted = tokens_data(size, 3)
    sets.append(("tokens /4KiB", data, planted))

    # The install's own secrets: 20 values like the ones scan_env picks up.
    r = random.Random(4)
    secrets = [(f"SECRET_{i}", "".join(r.choice(B62 + "-_/+=") for _ in range(r.randrange(16, 60))))
               for i in range(20)]
    sets.append((f"clean, {len(secrets)} stored secrets", sets[0][1], 0))

    mb = 2**20
    rows = []
    for name, data, planted in sets:
        det = Detector(secrets) if "stored" in name else Detector()
        print(f"{name}: scan...", file=sys.stderr)
        t_scan, found = best_of(repeat, partial(det.scan, data))
        t_stream, sfound = best_of(repeat, partial(stream_scan, det, data))
        t_raw, rfound = best_of(repeat, partial(det._scan, data, detect._MAX_DEPTH))
        if "stored" in name:  # the baselines know no stored secrets: same as the clean row
            t_alt, t_prefix, t_naive = (rows[0][1] / rows[0][5], rows[0][1] / rows[0][6], rows[0][1] / rows[0][7])
        else:
            t_alt, _ = best_of(max(1, repeat // 2), partial(alternation_scan, data))
            t_prefix, _ = best_of(max(1, repeat // 2), partial(per_prefix_scan, data))
            print(f"{name}: naive...", file=sys.stderr)
            t_naive, nfound = best_of(1, partial(naive_scan, data))
        n = len(data) / mb
        rows.append((name, n, n / t_scan, n / t_stream, n / t_raw, n / t_alt, n / t_prefix, n / t_naive,
                     t_naive / t_raw, t_naive / t_scan, len(found), len(sfound), planted))

    total = sum(COMPOSITION.values())
    mix = ", ".join(f"{k} {v * 100 // total}%" for k, v in sorted(COMPOSITION.items(), key=lambda kv: -kv[1]))
    print(f"# scanner_bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPU, "
          f"Python {platform.python_version()}, {len(detect.RULES)} kinds, best of {repeat}; clean mix: {mix}")
    head = ("data set", "MiB", "scan MB/s", "stream MB/s", "raw MB/s", "1-regex MB/s", "per-prefix MB/s",
            "naive MB/s", "raw/naive", "scan/naive", "findings", "stream", "planted")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, n, scan, stream, raw, alt, prefix, naive, r1, r2, f, sf, planted in rows:
        print(f"| {name} | {n:.0f} | {scan:.1f} | {stream:.1f} | {raw:.1f} | {alt:.1f} | {prefix:.1f} | {naive:.2f} "
              f"| {r1:.0f}x | {r2:.0f}x | {f} | {sf} | {planted} |")
    if args.base:
        side_by_side(args, sets, repeat, secrets)


if __name__ == "__main__":
    main()
