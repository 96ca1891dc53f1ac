"""The `egress` command line.

Exit statuses and network modes are egress.core.contract's (documented in the README).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import urllib.parse
from pathlib import Path

import click

from egress import __version__
from egress.core.contract import (
    EXIT_OK,
    EXIT_POLICY,
    EXIT_REFUSED,
    EXIT_STATE,
    EXIT_USAGE,
    NETWORK_MODES,
    PROXY_MODE_ENV,
    PROXY_MODES,
)
from egress.policy.source import PolicySource
from egress.proxy.ca import StateError, ensure_ca
from egress.proxy.config import DEFAULT_LIMITS, ProxyConfig  # the limits addon's options and their defaults


class Fatal(Exception):
    """A failure that ends the command with a one-line reason and a documented status."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


def _fail(error: Fatal) -> None:
    click.echo(f"egress: {error}", err=True)
    sys.exit(error.status)


def _load_policy(sources: tuple[str, ...]):
    """The policy, as serve loads it (egress.policy.source; its credential settings checked beside
    it), for commands that read no secret (check)."""
    from egress.policy.loader import PolicyError

    try:
        return PolicySource(sources).load()
    except PolicyError as e:
        raise _unloadable(e) from None


def _load_for_proxy(sources: tuple[str, ...]):
    """(policy, credentials) with every check `serve` makes before it starts (egress.serve.single.load:
    the stored secrets' values read too), for redact."""
    from egress.policy import settings
    from egress.policy.loader import PolicyError

    try:
        policy = PolicySource(sources).load()
        return policy, settings.read_credentials(policy, dict(os.environ), broker=False)
    except PolicyError as e:
        raise _unloadable(e) from None


def _unloadable(error) -> Fatal:
    for problem in error.problems:
        click.echo(f"egress: {problem}", err=True)
    return Fatal(EXIT_POLICY, "the policy cannot be loaded (nothing was started)")


def _parse_address(text: str, option: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``PORT``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    from egress.core.hosts import InvalidHost, parse_port

    host = host.strip("[]") or "127.0.0.1"
    try:
        return host, parse_port(port, text, zero=True)
    except InvalidHost:
        raise click.BadParameter(f"{text!r}: expected HOST:PORT with a port 0-65535", param_hint=option) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="egress")
def main() -> None:
    """egress: one road out. An allow-list proxy that names what it refuses.

    \b
    Common commands:
      egress run -- CMD                 run CMD with egress as its only road out
      egress serve --policy my.toml     run the proxy (127.0.0.1:8080, metrics :9464)
      egress check example.com          would the policy allow it? (no network)
      egress policy validate my.toml    check a policy file
      egress ca path                    the CA certificate clients must trust
      egress redact < log               replace secrets in a stream with [redacted:<kind>]
      egress fence --source URL < page  fence untrusted text for an agent to read as data
    """


policy_option = click.option(
    "--policy", "policies", multiple=True, metavar="FILE",
    help="Policy file (TOML) or built-in set name; repeatable. Default: the built-in set 'dev'.")

# A str, as egress.entry makes it for `egress run` (which never imports pathlib).
state_dir_option = click.option(
    "--state-dir", type=click.Path(), envvar="EGRESS_STATE_DIR",
    help="Where egress keeps its CA, control sockets and warm proxy (default: $XDG_STATE_HOME/egress).")


# ----------------------------------------------------------------------- check


@main.command()
@policy_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per target, one per line.")
@click.option("--port", type=click.IntRange(1, 65535), help="Port to decide for (default: from the URL, else any).")
@click.argument("targets", nargs=-1, required=True, metavar="HOST_OR_URL...")
def check(policies: tuple[str, ...], as_json: bool, port: int | None, targets: tuple[str, ...]) -> None:
    """Say whether the policy allows each target, and which rule decided.

    No DNS, no connection: a name is decided as written; an IP literal or localhost
    (whose addresses need no lookup) is also refused as the proxy would refuse it,
    private-address, unless allow_private covers it. Exit status 0 if every target
    is allowed, 1 if not, 2 if a target is malformed.
    """
    parsed, malformed = [], False
    for target in targets:
        try:
            parsed.append((target, *_parse_target(target)))
        except ValueError as e:
            reason = str(e)  # InvalidHost's message often starts with the text it refused already
            click.echo(f"egress check: {reason}" if reason.startswith(repr(target)) else
                       f"egress check: {target!r}: {reason}", err=True)
            malformed = True
    if malformed:
        sys.exit(EXIT_USAGE)
    try:
        policy = _load_policy(policies)
    except Fatal as e:
        _fail(e)
    from egress.core.addresses import known_addresses
    from egress.policy.matcher import Decision

    refused = False
    for target, host, target_port in parsed:
        decision = policy.decide(host, port or target_port)
        addresses = known_addresses(host)
        if decision.allowed and addresses is not None:  # the proxy's next decision, needing no DNS
            chosen = policy.choose_address(host, decision.port, addresses)
            if isinstance(chosen, Decision):
                decision = chosen
        refused |= not decision.allowed
        if as_json:
            click.echo(json.dumps({
                "target": target, "host": decision.host, "port": decision.port,
                "decision": "allow" if decision.allowed else "block", "reason": decision.reason,
                "rule": str(decision.rule) if decision.rule else None, "detail": decision.detail,
            }))
        else:
            verdict = "allow" if decision.allowed else "block"
            click.echo(f"{verdict}: {decision.host}: {decision.words()}")
    sys.exit(EXIT_REFUSED if refused else EXIT_OK)


def _parse_target(target: str):
    """``host``, ``host:port``, ``[v6]:port`` or a URL -> (Host, port or None). Raises ValueError
    (InvalidHost is one) saying what is wrong."""
    from egress.core.hosts import parse_host, split_host_port

    if "://" in target:
        try:
            url = urllib.parse.urlsplit(target)
        except ValueError as e:  # "http://[bad"
            raise ValueError(f"not a valid URL ({e})") from None
        netloc = url.netloc.rpartition("@")[2]
        default = {"http": 80, "https": 443}.get(url.scheme.lower())
        host, target_port = split_host_port(netloc, default)
    else:
        if "/" in target:
            host = target.split("/", 1)[0]
            raise ValueError(f"a path without a scheme: write the host ({host!r}) or a URL "
                             f"('https://{target}')")
        host, target_port = split_host_port(target)
    return parse_host(host), target_port


# ---------------------------------------------------------------------- policy


@main.group()
def policy() -> None:
    """Work with policy files."""


@policy.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def validate(files: tuple[str, ...]) -> None:
    """Check policy files; print OK or every problem with file:line. Exit 1 if any.

    Each file is checked as `egress serve --policy FILE` checks it before starting,
    [credentials] included: secrets are read from this environment and the files
    they name. Warnings (file:line: warning: ...) name what loads but may open more
    than meant.
    """
    from egress.policy import settings
    from egress.policy.loader import PolicyError

    failed = False
    for file in files:
        try:  # serve's own load path: what it refuses at start (status 3) is a problem here
            loaded, _ = settings.load_for_proxy([file], dict(os.environ))
        except PolicyError as e:
            failed = True
            for problem in e.problems:
                click.echo(str(problem), err=True)
        else:
            for warning in loaded.warnings:
                click.echo(warning.as_warning(), err=True)
            click.echo(f"{file}: OK ({loaded.size} from {len(loaded.files)} file{'' if len(loaded.files) == 1 else 's'})")
    sys.exit(EXIT_REFUSED if failed else EXIT_OK)


# -------------------------------------------------------------------------- ca


@main.group()
def ca() -> None:
    """The CA that signs intercepted TLS connections."""


@ca.command("path")
@state_dir_option
def ca_path(state_dir: str | None) -> None:
    """Print the CA certificate's path (creating the CA if needed)."""
    try:
        click.echo(str(ensure_ca(state_dir)))
    except StateError as e:
        _fail(Fatal(EXIT_STATE, str(e)))


# ------------------------------------------- the proxy's options (serve and run)




def proxy_options(*, metrics: str, audit_log: str):
    """The options that shape a proxy, shared by `serve` and `run`: same names, same meaning, one
    egress.proxy.config.ProxyConfig made of them (passed as ``proxy``). Only two defaults differ: a
    command's stdout is its own, and one run rarely wants an endpoint of its own."""
    options = [
        click.option("--metrics", default=metrics, show_default=True, metavar="HOST:PORT|off",
                     help="Prometheus metrics address (/metrics); port 0 picks a free port (printed)."),
        click.option("--audit-log", default=audit_log, show_default=True, metavar="FILE|-|off",
                     help="Where to write one JSON line per decision ('-' is standard output)."),
        click.option("--resolve", "overrides", multiple=True, metavar="HOST:ADDR",
                     help="Resolve HOST to ADDR without DNS (like curl's --resolve); repeatable."),
        click.option("--dns-server", metavar="ADDR[:PORT]",
                     help="Ask this DNS server instead of the system's resolvers (port 53 unless given)."),
        click.option("--dns-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 60),
                     help="Seconds to wait for DNS answers."),
        click.option("--upstream-timeout", default=60.0, show_default=True, type=click.FloatRange(0),
                     help="Seconds to wait for an upstream's response head before answering 504 "
                          "(0: wait forever)."),
        # Checked by egress.proxy.trust when the proxy is built (one line, status 5 / 125), not by click (2).
        click.option("--upstream-ca", type=click.Path(path_type=Path), metavar="FILE",
                     help="Also trust this CA (PEM) for upstream servers, beside the system's CAs "
                          "(e.g. the CA of a proxy that re-signs TLS on your network)."),
        state_dir_option,
        click.option("--max-client-connections", default=DEFAULT_LIMITS["egress_max_client_connections"],
                     show_default=True, type=click.IntRange(0),
                     help="Open connections allowed per client address (0: no limit)."),
        click.option("--idle-timeout", default=DEFAULT_LIMITS["egress_idle_timeout"], show_default=True,
                     type=click.FloatRange(0.1),
                     help="Seconds a connection may exchange nothing before it is closed."),
        click.option("--head-timeout", default=DEFAULT_LIMITS["egress_head_timeout"], show_default=True,
                     type=click.FloatRange(0),
                     help="Seconds a client may take to send a complete request head, idle keep-alive "
                          "included (0: no limit)."),
        click.option("--max-head-size", default=DEFAULT_LIMITS["egress_max_head_bytes"], show_default=True,
                     type=click.IntRange(1024),
                     help="Largest request head in bytes; a larger one is answered 431."),
        click.option("--label-injection", is_flag=True,
                     help="Score small text responses (up to 256 KiB, with a Content-Length) for prompt-injection "
                          "signals and name them in an X-Egress-Injection header; streamed bodies pass unlabelled."),
    ]

    def decorate(command):
        @functools.wraps(command)
        def with_config(*args, metrics, audit_log, overrides, dns_server, dns_timeout, upstream_timeout,
                        upstream_ca, state_dir, max_client_connections, idle_timeout, head_timeout,
                        max_head_size, label_injection, **kwargs):
            config = proxy_config(metrics=metrics, audit_log=audit_log, overrides=overrides,
                                  dns_server=dns_server, dns_timeout=dns_timeout,
                                  upstream_timeout=upstream_timeout, upstream_ca=upstream_ca,
                                  state_dir=state_dir,
                                  limits=dict(egress_max_client_connections=max_client_connections,
                                              egress_idle_timeout=idle_timeout, egress_head_timeout=head_timeout,
                                              egress_max_head_bytes=max_head_size,
                                              egress_label_injection=label_injection))
            return command(*args, proxy=config, **kwargs)

        for option in reversed(options):
            with_config = option(with_config)
        return with_config

    return decorate


def proxy_config(*, metrics: str, audit_log: str, overrides=(), dns_server: str | None = None,
                 dns_timeout: float = 5.0, upstream_timeout: float = 60.0, upstream_ca: Path | None = None,
                 state_dir: str | None = None, listen: tuple[str, int] | None = None, limits=None):
    """The option values, checked (click.BadParameter: a usage error), as one ProxyConfig."""
    return ProxyConfig(
        listen=listen,
        metrics=None if metrics == "off" else _parse_address(metrics, "--metrics"),
        audit_log=None if audit_log == "off" else audit_log,
        resolve=_parse_overrides(overrides),
        dns_server=_parse_dns_server(dns_server) if dns_server else None,
        dns_timeout=dns_timeout, upstream_timeout=upstream_timeout, upstream_ca=upstream_ca,
        state_dir=state_dir, extra_options=dict(DEFAULT_LIMITS if limits is None else limits))


def _parse_dns_server(text: str) -> tuple[str, int]:
    """``ADDR``, ``ADDR:PORT`` or ``[V6]:PORT``; the port defaults to 53."""
    import ipaddress

    from egress.core.hosts import InvalidHost, split_host_port

    try:
        host, port = split_host_port(text, 53)
    except InvalidHost:
        raise click.BadParameter(f"{text!r}: bad port", param_hint="--dns-server") from None
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected an IP address, e.g. 10.0.0.2 or 127.0.0.1:5353",
                                 param_hint="--dns-server") from None
    return host, port


def _parse_overrides(values: tuple[str, ...]) -> dict:
    from egress.core.hosts import parse_override

    result: dict = {}
    for value in values:
        try:
            host, ip = parse_override(value)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--resolve") from None
        result.setdefault(host, []).append(ip)
    return result


# ----------------------------------------------------------------------- serve


@main.command()
@policy_option
@click.option("--listen", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Proxy address; port 0 picks a free port (printed on start-up).")
@click.option("--auth", metavar="USER:PASSWORD", envvar="EGRESS_AUTH",
              help="Answer only clients that send these credentials (http://USER:PASSWORD@HOST:PORT); "
                   "others get 407. For a proxy others on the host can reach. [env: EGRESS_AUTH]")
@click.option("--workers", type=click.IntRange(1, 1024), metavar="N",
              help="Proxy processes sharing the address, the kernel spreading connections over them "
                   "(SO_REUSEPORT; Linux). Default: the CPUs egress may run on. 1: a single process.")
@proxy_options(metrics="127.0.0.1:9464", audit_log="-")
def serve(policies, listen, auth, workers, proxy) -> None:
    """Run the proxy until SIGINT or SIGTERM."""
    from egress.proxy.build import BuildError
    from egress.serve import single, workers as several

    config = proxy._replace(listen=_parse_address(listen, "--listen"), auth=_parse_auth(auth))
    # Passthrough CONNECTs answered before mitmproxy (egress.proxy.fastpath); EGRESS_PASSTHROUGH_FRONT=off
    # leaves every connection to mitmproxy, as before. Not with --auth: every client is mitmproxy's.
    config = config._replace(front=config.auth is None and os.environ.get("EGRESS_PASSTHROUGH_FRONT") != "off")
    count = workers or several.default_count()
    if count > 1 and not sys.platform.startswith("linux"):
        raise click.BadParameter("more than 1 needs Linux, whose SO_REUSEPORT spreads connections "
                                 "over the workers", param_hint="--workers")
    try:
        status = several.serve(PolicySource(policies), config, count) if count > 1 else \
            single.serve(PolicySource(policies), config)
    except BuildError as e:
        _fail(Fatal(e.status, str(e)))
    if status:
        sys.exit(status)


def _parse_auth(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    from egress.proxy.auth import parse

    try:
        return parse(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--auth") from None


# ------------------------------------------------------- runs, allow, events


def _run_socket(run: str | None, state_dir: str | None) -> Path:
    from egress.host.control import list_runs, run_socket

    if run is None:
        live = list_runs(state_dir)
        if len(live) != 1:
            names = ", ".join(r["run"] for r in live) or "none"
            raise click.UsageError(f"name the run with --run ID (running: {names})")
        run = live[0]["run"]
    path = Path(run_socket(state_dir, run))
    if not path.exists():
        raise click.UsageError(f"no run {run!r} is running (see `egress runs`)")
    return path


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
@state_dir_option
def runs(as_json: bool, state_dir: str | None) -> None:
    """List the egress runs in progress, with their grants."""
    from egress.host.control import list_runs

    for info in list_runs(state_dir):
        if as_json:
            click.echo(json.dumps(info))
        else:
            grants = ", ".join(info["grants"]) or "-"
            click.echo(f"{info['run']}  pid {info['pid']}  {' '.join(info['command'])[:60]}  granted: {grants}")


@main.command()
@click.argument("host")
@click.option("--run", "run", metavar="ID", help="The run to grant (see `egress runs`); optional if only one runs.")
@state_dir_option
def allow(host: str, run: str | None, state_dir: str | None) -> None:
    """Allow HOST (that exact name) for one run, answering its pending question too.

    Only an `egress run` takes grants; an `egress serve` refuses them (exit 1): edit
    its policy file instead, which it reloads live.
    """
    from egress.host.control import request

    for answer in request(_run_socket(run, state_dir), {"op": "allow", "host": host}):
        if "error" in answer:
            click.echo(f"egress: {answer['error']}", err=True)
            sys.exit(EXIT_REFUSED)
        click.echo(f"allowed {answer['host']} for this run")


@policy.command("reload")
@click.option("--run", "run", metavar="ID", help="The run or serve (see `egress runs`); optional if only one.")
@state_dir_option
def policy_reload(run: str | None, state_dir: str | None) -> None:
    """Make a running proxy re-read its policy files now (they are also watched)."""
    from egress.host.control import request

    for answer in request(_run_socket(run, state_dir), {"op": "reload"}):
        if "error" in answer:
            click.echo(f"egress: {answer['error']}", err=True)
            sys.exit(EXIT_REFUSED)
        click.echo("reload requested; the proxy reports the outcome on its stderr")


@main.command()
@click.option("--follow", is_flag=True, help="Keep streaming (events are always live).")
@click.option("--run", "run", metavar="ID", help="The run to follow; optional if only one runs.")
@click.option("--json", "as_json", is_flag=True, help="The events as JSON lines.")
@state_dir_option
def events(follow: bool, run: str | None, as_json: bool, state_dir: str | None) -> None:
    """Stream a run's decisions as they happen."""
    from egress.host.control import request

    try:
        for event in request(_run_socket(run, state_dir), {"op": "events"}):
            if "error" in event:
                click.echo(f"egress: {event['error']}", err=True)
                sys.exit(EXIT_REFUSED)
            if as_json:
                click.echo(json.dumps(event))
            else:
                click.echo(f"{event['decision']:<5} {event['method']:<7} {event['host']}:{event['port']}  "
                           f"{event['reason']}" + (f" ({event['detail']})" if event.get("detail") else ""))
    except (KeyboardInterrupt, BrokenPipeError):
        pass


# ---------------------------------------------------------------------- doctor


@main.command()
@policy_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per check, one per line.")
@click.option("--no-fs-confinement", is_flag=True, help="Judge `egress run --no-fs-confinement`.")
@state_dir_option
def doctor(policies, as_json, no_fs_confinement, state_dir) -> None:
    """Tell what isolation this machine gives, one line per mechanism, with fixes.

    Exit status 0 when `egress run` can be honoured here, 1 when it cannot.
    Set EGRESS_DOCTOR_SIMULATE=no-userns,no-landlock,not-linux to rehearse failures.
    """
    from egress.run.doctor import run_checks

    checks, honoured = run_checks(list(policies), state_dir, fs_confinement=not no_fs_confinement)
    for check in checks:
        click.echo(json.dumps(check.as_dict()) if as_json else check.line())
    if not as_json:
        click.echo("egress run can confine commands here" if honoured else
                   "egress run cannot confine commands here: it will refuse to run them (see above)")
    sys.exit(EXIT_OK if honoured else EXIT_REFUSED)


# ---------------------------------------------------------------------- redact


@main.command()
@policy_option
@click.option("--guard-write", "guard_write", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Instead: write standard input to FILE, unless it would put a [redacted:...] placeholder "
                   "where FILE holds a value (status 1, the lines named, FILE untouched).")
def redact(policies: tuple[str, ...], guard_write: Path | None) -> None:
    """Copy standard input to standard output with secrets replaced by [redacted:<kind>].

    Well-known token formats, the install's stored secrets (the policy's
    [credentials] and secret-named environment variables), and NAME=value lines
    whose NAME marks a secret. Streams: nothing is held back longer than needed.

    With --guard-write FILE, the write guard: a file read through redaction and
    written back must not replace its secrets with their placeholders.
    """
    if guard_write is not None:
        from egress.agent.write_guard import WriteRefused, guarded_write

        try:
            guarded_write(str(guard_write), sys.stdin.buffer.read())
        except WriteRefused as e:
            for clobber in e.clobbers:
                click.echo(f"egress: {guard_write}: refused: {clobber}", err=True)
            sys.exit(EXIT_REFUSED)
        except OSError as e:
            click.echo(f"egress: {guard_write}: {e.strerror or e}", err=True)
            sys.exit(EXIT_STATE)
        return
    from egress.scan.detect import Detector, StreamRedactor

    try:
        _, credentials = _load_for_proxy(policies)
    except Fatal as e:
        _fail(e)
    redactor = StreamRedactor(Detector([(s.label, s.value) for s in credentials.secrets]))
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while chunk := source.read1(65536):
        sink.write(redactor.feed(chunk))
        sink.flush()
    sink.write(redactor.finish())
    sink.flush()


# ----------------------------------------------------------------------- fence


@main.command()
@click.option("--source", metavar="NAME", help="Where the text came from (a URL, a file, a tool), written outside the fence.")
@click.option("--field", "fields", multiple=True, metavar="KEY=VALUE",
              help="Another trusted field written outside the fence; repeatable.")
@click.option("--score", "score_only", is_flag=True,
              help="Instead of the fence, print the text's prompt-injection signals and score as one JSON object.")
def fence(source: str | None, fields: tuple[str, ...], score_only: bool) -> None:
    """Write standard input inside <untrusted-content-NONCE> tags for an agent to read as data.

    \b
    A fresh 128-bit nonce per call, so the text cannot close the fence; fence tags in
    the text are escaped; characters hidden from a reader (bidirectional controls,
    zero-width and tag characters) are stripped. --score reports prompt-injection
    signals and a score from 0 to 1 (egress.agent.fence.SIGNALS lists them).
    """
    from egress.agent import fence as fencing

    pairs = []
    for field in fields:
        key, equals, value = field.partition("=")
        if not equals:
            raise click.BadParameter(f"{field!r}: expected KEY=VALUE", param_hint="--field")
        pairs.append((key, value))
    text = sys.stdin.buffer.read().decode("utf-8", "replace")
    if score_only:
        click.echo(json.dumps(fencing.score(text).as_dict()))
        return
    try:
        fenced = fencing.fence(text, source=source, fields=pairs)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--field") from None
    sys.stdout.write(fenced)


# ------------------------------------------------------------------------- run


class ByteSize(click.ParamType):
    """A byte count: 262144, 256K, 1M (egress.agent.output_cap.parse_size; egress.entry takes the same)."""

    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from egress.agent.output_cap import parse_size

        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@main.command(context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@click.option("--network", type=click.Choice(NETWORK_MODES),
              help="allowlist (default): built-in 'dev' plus your policy; all: every domain except the "
                   "deny list (private addresses still refused); off: no network at all. "
                   "Overrides a policy file's `network` key.")
@policy_option
@click.option("--allow", multiple=True, metavar="DOMAIN", help="Also allow DOMAIN (and its subdomains; =DOMAIN: that host only); repeatable.")
@click.option("--deny", multiple=True, metavar="DOMAIN", help="Refuse DOMAIN (and its subdomains); wins over any allow.")
@click.option("--project", type=click.Path(file_okay=False), default=".",
              help="The folder the command may write to (default: the current directory); also its working directory.")
@click.option("--add-dir", "add_dirs", multiple=True, type=click.Path(file_okay=False),
              metavar="DIR", help="Another folder the command may write to; repeatable.")
@click.option("--read", "read", multiple=True, type=click.Path(exists=True), metavar="PATH",
              help="Also show PATH (a folder or file) to the command, read-only: outside the project, "
                   "system folders and toolchains it sees nothing else (Linux); repeatable.")
@click.option("--allow-hooks", is_flag=True,
              help="Let the command change what runs later outside the sandbox: git hooks and config, "
                   ".gitmodules, .vscode, .idea, .claude, .mcp.json, .envrc (read-only by default).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Kill the command and everything it started after SECONDS; exit status 124.")
@click.option("--no-fs-confinement", is_flag=True,
              help="Let the command write anywhere its user may (only where Landlock is missing).")
@click.option("--redact", is_flag=True,
              help="Pass the command's output through the secret redactor (as `egress redact`).")
@click.option("--ask", type=click.Choice(["tty", "never"]),
              help="Ask on the terminal to allow a refused host for this run (default: tty when there is one).")
@click.option("--headless", is_flag=True, help="Never ask (same as --ask never).")
@click.option("--proxy", "proxy_mode", type=click.Choice(list(PROXY_MODES)), envvar=PROXY_MODE_ENV,
              help="warm (default): the run's proxy is a child of your warm egress process (started on "
                   "first use, gone after 10 idle minutes); lazy: it starts in this process when the "
                   "command first connects. [env: EGRESS_PROXY]")
@click.option("--agent", is_flag=True,
              help="For agent harnesses: --headless, --redact, --guard-commands, --max-output 256K and "
                   "--timeout 120, each of which can still be given (as a policy's profile = \"agent\").")
@click.option("--max-output", type=ByteSize(), metavar="BYTES",
              help="Cap each of the command's streams at BYTES (K, M, G: 1024s): its first 60% and last 40% "
                   "are kept, the middle replaced by one line saying how many bytes were elided. 0: no cap. "
                   "Default: the policy's [limits] max_output.")
@click.option("--guard-commands", is_flag=True,
              help="Refuse (status 125) a command on the deny list: built-in (sudo, rm -rf /, mkfs, ...) "
                   "and the policy's [guardrails] deny_commands, unless allow_commands lets it through.")
@click.option("--provider", type=click.Choice(["namespace", "seatbelt", "podman", "docker", "local"]),
              help="What holds the command: namespace (Linux default), seatbelt (macOS default), podman or "
                   "docker (a hardened container in egress's network namespace; needs --image), local (NOT a "
                   "sandbox: the proxy variables only).")
@click.option("--image", metavar="IMAGE", help="podman/docker: the container image (else the policy's [container] image).")
@click.option("--mount", "mounts", multiple=True, metavar="SRC:DST[:rw]",
              help="podman/docker: also mount SRC at DST, read-only unless :rw; repeatable.")
@click.option("--persist", multiple=True, metavar="NAME",
              help="podman/docker: keep the named volume NAME at /persist/NAME across runs; repeatable.")
@proxy_options(metrics="off", audit_log="off")
@click.argument("command", nargs=-1, required=True, metavar="-- COMMAND [ARGS]...")
def run(network, policies, allow, deny, project, add_dirs, read, allow_hooks, timeout, no_fs_confinement, redact,
        ask, headless, proxy_mode, agent, max_output, guard_commands, provider, image, mounts, persist, proxy,
        command) -> None:
    """Run COMMAND where the egress proxy is its only road out (Linux: own network namespace; macOS: a
    Seatbelt profile; elsewhere it refuses with status 125).

    The exit status is the command's; 124 after --timeout; 125 when egress run itself
    failed (bad policy, missing folder, sandbox refused, metrics port in use); 126/127
    cannot execute / not found. Every refusal is printed on stderr as
    `EGRESS_BLOCKED <host> (<reason>)`, every upstream failure (DNS, connect, TLS, timeout) as
    `EGRESS_UPSTREAM_ERROR <host> (<reason>)`. The proxy options mean what they mean for serve.
    """
    from egress.run.launcher import main as launch  # the platform's sandbox, or status 125 where there is none

    launch(run_options(network, policies, allow, deny, project, add_dirs, timeout, no_fs_confinement, redact, ask,
                       headless, proxy_mode, proxy, command, agent, max_output, guard_commands, provider, image,
                       mounts, persist, read, allow_hooks))


def run_options(network, policies, allow, deny, project, add_dirs, timeout, no_fs_confinement, redact, ask,
                headless, proxy_mode, proxy, command, agent=False, max_output=None, guard_commands=False,
                provider=None, image=None, mounts=(), persist=(), read=(), allow_hooks=False):
    """`egress run`'s parameters as the launcher takes them (egress.entry makes the same without click)."""
    from egress.run.launcher import RunOptions

    return RunOptions(argv=list(command), network=network, policies=list(policies), allow=list(allow),
                      deny=list(deny), project=project, add_dirs=list(add_dirs), timeout=timeout,
                      fs_confinement=not no_fs_confinement, proxy=proxy, redact=redact,
                      ask="never" if headless else ask, proxy_mode=proxy_mode, agent=agent,
                      max_output=max_output, guard_commands=guard_commands, provider=provider, image=image,
                      mounts=list(mounts), persist=list(persist), read=list(read), allow_hooks=allow_hooks)


if __name__ == "__main__":
    main()
