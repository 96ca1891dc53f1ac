"""`egress serve` as one process (`--workers 1`): the proxy on its address, its policy watched,
its control socket, its lines on stderr, until SIGINT or SIGTERM (SIGHUP reloads).

    serve(PolicySource(files), config)     # raises BuildError: serve's exit status and its reason

Also what `egress serve --workers N` shares with it (egress.serve.workers): the policy's load
with its problems, the control socket's state and the start-up lines.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from egress.core.contract import EXIT_POLICY
from egress.host.control import ControlServer, RunState
from egress.host.service import ProxyService
from egress.observe.terminal import EventLines
from egress.policy import settings
from egress.policy.loader import PolicyError
from egress.policy.source import PolicySource
from egress.proxy.build import BuildError, ProxyBuilder, format_address
from egress.proxy.config import ProxyConfig


def serve(source: PolicySource, config: ProxyConfig) -> int:
    """Serve until SIGINT or SIGTERM; the exit status (0). Raises BuildError, with serve's status:
    the policy (3), the listen or metrics address (4), the audit log, the upstream CAs or the CA (5)."""
    from egress.proxy.master import configure_logging  # mitmproxy: not for the supervisor of workers

    configure_logging()
    builder = ProxyBuilder(config)
    control = control_state(source)
    service = ProxyService(builder, lambda: load(source), reload=source.reload, paths=source.files,
                           report=lambda line: say(f"egress: {line}"),
                           # upstream failures on stderr, as egress run prints them (refusals are in the audit log)
                           observers={"log": EventLines(blocked=False)}, control=control,
                           stop_on=(signal.SIGINT, signal.SIGTERM), reload_on=(signal.SIGHUP,))
    try:
        try:
            policy = service.load()  # the policy (3) before anything else
        except PolicyError as e:
            raise unloadable(e, lambda problem: say(f"egress: {problem}")) from None
        for warning in policy.warnings:
            say(f"egress: {warning.as_warning()}")
        del policy  # the engine's alone, once it starts: a reload must leave nothing else holding it
        builder.open()  # the audit log (5) and the metrics port (4)
        builder.serve_metrics()
        if builder.metrics_url:
            control.extra["metrics"] = builder.metrics_url
        asyncio.run(_serve(service, control, config))
    finally:
        service.close()
    return 0


async def _serve(service: ProxyService, state: RunState, config: ProxyConfig) -> None:
    await service.start()
    control = control_server(state, config.state)
    say_serving(service.builder.bound, service.builder, service.engine.policy, config)
    try:
        await service.run_until_stopped()
    finally:
        if control is not None:
            control.close()


def load(source: PolicySource) -> tuple:
    """(policy, credentials): every check serve makes before it starts, as `policy validate` makes
    them (the files, their credential settings, the stored secrets' values read now). Raises
    PolicyError."""
    policy = source.load()
    return policy, settings.read_credentials(policy, dict(os.environ), broker=False)


def unloadable(error: PolicyError, report) -> BuildError:
    """A policy that did not load: ``report(problem)`` for each of its problems; serve's status 3."""
    for problem in error.problems:
        report(problem)
    return BuildError(EXIT_POLICY, "the policy cannot be loaded (nothing was started)")


def control_state(source: PolicySource, metrics_url: str | None = None) -> RunState:
    """What serve's control socket shows: ``serve-<pid>``, no grants (and the road instead)."""
    run_id = f"serve-{os.getpid()}"
    files = source.files
    road = (f"add the host to the allow list in {' or '.join(files)}: serve applies the edit to the "
            f"next request (at once with `egress policy reload --run {run_id}`)" if files else
            "it runs the built-in policy: restart it with --policy FILE allowing the host (edits to "
            "that file then apply live)")
    state = RunState(run_id, ["egress", "serve", *sys.argv[2:]], no_grants=(
        f"{run_id} is an egress serve, shared by all its clients: it takes no grants (they are for "
        f"one egress run); {road}"))
    if metrics_url:
        state.extra["metrics"] = metrics_url
    return state


def control_server(state: RunState, state_dir) -> ControlServer | None:
    try:
        return ControlServer(state, state_dir)
    except OSError as e:
        say(f"egress: no control socket ({e}); egress events/reload will not reach this proxy")
        return None


def say_serving(bound, builder: ProxyBuilder, loaded, config: ProxyConfig) -> None:
    """serve's start-up lines, once it serves."""
    for host, port in bound:
        say(f"egress: proxy listening on {format_address(host, port)}")
    if config.auth is not None:
        say(f"egress: clients must authenticate as {config.auth[0]} (http://{config.auth[0]}:"
            f"PASSWORD@HOST:PORT); others get 407")
    if builder.metrics_url:
        say(f"egress: metrics on {builder.metrics_url}")
    say(f"egress: policy {', '.join(loaded.files)} ({loaded.size}); CA certificate {config.state.ca_cert}")
    say(f"egress: upstream certificates verified against {builder.trust.describe()}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
