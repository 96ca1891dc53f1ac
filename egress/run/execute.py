"""`egress run`'s execution: the prepared command run to its end.

    execute(prepared) -> status   the sandbox started; the policy files it can write sealed; the
                                  proxy handed to the warm proxy or served lazily here; the
                                  command's output relayed and signals forwarded until it ends;
                                  what it left behind said and moved aside; everything given back

The launcher talks to the proxy only through egress.run.session.ProxySession: a socket handed
over and a stream of events (DESIGN: no mitmproxy internals here).
"""

from __future__ import annotations

import errno
import os
import sys

from egress.core.contract import EXIT_NOT_FOUND, EXIT_TIMEOUT
from egress.observe.terminal import EventLines, say
from egress.run.options import LaunchError
from egress.run.prepare import Prepared
from egress.run.relay import TerminalGuard, forward_signals, restore_signals, stdio_fds
from sandbox import environment
from sandbox.paths import command_writable
from sandbox.spec import SandboxError

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from egress.proxy.build import ProxyBuilder
    from egress.run.plan import RunPlan
    from egress.run.warm.client import Handover
    from sandbox.api import Box


def execute(prepared: Prepared) -> int:
    """Run the prepared command; return its exit status (or a launcher status). Raises LaunchError.
    Gives back everything the run made, ``prepared``'s too, however it ends."""
    plan = prepared.plan
    terminal = TerminalGuard()  # before the command can take the terminal's foreground
    box = handover = proxy = session = None
    try:
        box = start_sandbox(prepared)
        if plan.platform.holds_until_ready:  # its sandbox is made meanwhile (sandbox/linux.py)
            prepared.write_files()
        if plan.networked:
            builder = prepared.builder
            assert builder is not None  # prepare opens one for every networked run
            trees = seal_policy(prepared)
            if plan.where == "warm":
                handover = offer_warm(prepared, builder, trees)
            proxy = RunProxy(prepared, builder, handover)
        command_started(box, plan)
        if proxy is not None:
            session = proxy.serve(box)
        status = wait(box, prepared.outputs, plan.options.timeout)
        say_how_it_ended(status, box, prepared, session)
        return status
    finally:
        if session is not None:
            session.stop()
        elif handover is not None:
            handover.close()  # the command never ran: the warm proxy's child ends at this EOF
        if proxy is not None:
            proxy.control.close()
        prepared.close(box, terminal)


def start_sandbox(prepared: Prepared) -> Box:
    """The command's sandbox, started: where the platform holds the command back until
    box.ready() (Linux), the sandbox is made while this process sets up its side (the files the
    command's environment names, the proxy). Raises LaunchError."""
    plan, spec, listener = prepared.plan, prepared.spec, prepared.listener
    assert spec is not None and listener is not None  # prepare made both
    try:
        box = plan.platform.start(spec, listener)
    except SandboxError as e:
        raise sandbox_failure(e, plan) from None
    prepared.listener = None  # the box holds its socket now
    return box


def command_started(box: Box, plan: RunPlan) -> None:
    """Let the command run (where the platform held it back) and wait until it has started.
    Raises LaunchError."""
    try:
        box.ready()
    except SandboxError as e:
        raise sandbox_failure(e, plan) from None


def seal_policy(prepared: Prepared) -> list[str]:
    """From now on files the command can write are read no more (egress.run.snapshot): the
    warm proxy gets their texts of now, and builds the run's proxy while the sandbox starts.
    (Nothing has read a policy file since the user's were loaded, by the plan.)
    Returns the writable trees as the predicate takes them."""
    trees = [os.path.join(os.getcwd(), tree) for tree in prepared.writable_anywhere]  # as the sandbox took them
    read_only = prepared.own_code
    prepared.plan.reader.seal(lambda path: command_writable(path, trees, read_only))
    return trees


def offer_warm(prepared: Prepared, builder: ProxyBuilder, trees: list[str]) -> Handover | None:
    """The run's request to the warm proxy, sent now if it runs (see egress.run.warm.client.Handover); None
    if it cannot be used (the run's proxy then starts in this process)."""
    from egress.run.warm.client import Handover, installation

    plan = prepared.plan
    options, credentials = plan.options, plan.credentials
    # stdout and stderr go when the run's child says it serves (egress.run.session): a child holding
    # them while it builds a proxy that a `true` never uses kept whoever reads egress's output
    # waiting after egress had ended (60a6b16 measured it). With `--audit-log -` the audit lines are stdout.
    fds = stdio_fds(("stdout",) if builder.audit is sys.stdout else ())
    if builder.audit is not None and builder.audit is not sys.stdout:
        fds["audit"] = builder.audit.fileno()
    if builder.metrics_socket is not None:
        fds["metrics"] = builder.metrics_socket.fileno()
    umask = os.umask(0o077)
    os.umask(umask)
    request = {"installation": installation(), "run_id": prepared.run_id, "argv": options.argv, "cwd": os.getcwd(),
               "umask": umask, "environ": plan.environ, "config": options.proxy.to_dict(), "mode": plan.mode,
               "network": options.network, "policies": options.policies, "allow": options.allow,
               "deny": options.deny,
               "snapshot": {"recorded": plan.reader.recorded(), "trees": trees, "read_only": prepared.own_code},
               "credentials": credentials.to_dict() if credentials is not None else None}
    return Handover.offer(options.state_dir, request, fds)


class RunProxy:
    """The run's side of its proxy, made before the command runs: its metrics served (unless the
    warm proxy serves them), its control socket (egress.host.control: grants, reloads, followers),
    the lines it says (EGRESS_BLOCKED and EGRESS_UPSTREAM_ERROR, once per host and reason) and who
    answers "allow this host for this run?"."""

    def __init__(self, prepared: Prepared, builder: ProxyBuilder, handover: Handover | None):
        from egress.host.control import ControlServer, RunState

        self.prepared = prepared
        self.builder = builder
        self.handover = handover
        options = prepared.plan.options
        if handover is None:  # else the warm proxy serves them (or this process, if it falls back)
            builder.serve_metrics()  # its port was bound before the command started; threads only now
        self.state = RunState(prepared.run_id, options.argv)
        if builder.metrics_url:
            self.state.extra["metrics"] = builder.metrics_url
            say(f"egress: metrics on {builder.metrics_url}")
        self.reporter = EventLines()
        self.asker = asker(options, self.state)
        self.control = ControlServer(self.state, options.state_dir)

    def on_event(self, event) -> None:
        self.reporter(event)
        self.state.publish(event)

    def serve(self, box: Box):
        """The run's ProxySession, serving the box's socket (and its capture's) from now on: in the
        warm proxy if it took the run, else in this process when the command first connects."""
        from egress.run.session import ProxySession

        prepared = self.prepared
        plan = prepared.plan
        session = ProxySession(plan.policy_and_credentials, prepared.run_id, self.builder,
                               on_event=self.on_event, reload=plan.source.reload,
                               watch=list(plan.options.policies), frozen=plan.reader.frozen_files,
                               asker=self.asker, state=self.state, warm=self.handover)
        session.serve_lazily(box.listen_socket, box.capture)
        if box.capture_error is not None:
            self.state.extra["capture"] = f"unavailable: {box.capture_error}"
        return session


def asker(options, state):
    """Who answers "allow this host for this run?": the terminal, or nobody (headless)."""
    from egress.run.ask import NeverAsk, TerminalAsker

    has_terminal = sys.stdin.isatty() and sys.stderr.isatty()
    if options.ask == "tty" or (options.ask is None and has_terminal):
        return TerminalAsker(state, " ".join(options.argv)[:80])
    return NeverAsk(state)


def wait(box: Box, outputs, timeout: float | None) -> int:
    """The command's status once it has ended (or been killed at ``timeout``), its output relayed
    and the signals egress gets forwarded to it meanwhile."""
    if outputs is not None:
        outputs.start()
    previous = forward_signals(box)
    try:
        return box.wait(timeout)
    finally:
        restore_signals(previous)
        if outputs is not None:
            outputs.finish()


def say_how_it_ended(status: int, box: Box, prepared: Prepared, session) -> None:
    """What the user should know of the run's end: a timeout, a client that went around the proxy,
    the proxy's failure, and what the command made that would run outside the sandbox later."""
    plan = prepared.plan
    options, env = plan.options, prepared.env
    if status == EXIT_TIMEOUT and options.timeout is not None:
        say(f"egress: timed out after {options.timeout:g} s; the command and everything it "
            f"started were killed")
    elif status != 0 and session is not None and box.direct_attempts() and not session.saw_connection():
        # It failed, egress's proxy never saw it, and it tried the network around it: a
        # client that ignores the proxy variables (node's fetch() before Node 22.21/24.5).
        say(environment.direct_connection_hint(options.argv[0], env["PATH"], plan.project, env["HTTPS_PROXY"]))
    if session is not None and session.error is not None:
        say(f"egress: the proxy failed: {session.error}")
    for line in quarantine(prepared.absent, plan.state_dir, prepared.run_id):
        say(line)


def quarantine(absent: list[str], state_dir: str, run_id: str) -> list[str]:
    """Move aside what the command made of the paths that run later (missing when it started),
    into the state folder; one line each for the user. Nothing is deleted."""
    made = [path for path in absent if os.path.lexists(path)]
    if not made:
        return []
    folder = os.path.join(state_dir, "quarantine", run_id)
    lines = []
    for path in made:
        target = os.path.join(folder, path.lstrip("/"))
        try:
            try:
                os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                os.rename(path, target)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                target = f"{path}.egress-quarantine-{run_id}"  # another file system: beside it, under a name nothing runs
                os.rename(path, target)
            lines.append(f"egress: the command made {path}, which would run outside the sandbox later; "
                         f"moved to {target} (egress run --allow-hooks lets a command make it)")
        except OSError as e:
            lines.append(f"egress: the command made {path}, which would run outside the sandbox later, and it "
                         f"could not be moved aside ({e.strerror}): look at it before you use this folder")
    return lines


def sandbox_failure(error: SandboxError, plan: RunPlan) -> LaunchError:
    """The sandbox's refusal as egress run says it, with an install hint for a missing runtime."""
    missing = error.code == EXIT_NOT_FOUND
    hint = environment.missing_runtime_hint(plan.options.argv[0], plan.platform.name) if missing else None
    return LaunchError(str(error) + (f"\n{hint}" if hint else ""), error.code)
