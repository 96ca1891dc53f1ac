"""`egress run -- CMD`: the command in its own sandbox, the egress proxy its only road out.

    policy  ->  sandbox (netns with only lo, a listening socket inside, Landlock)  ->  command
                     \\-> the socket is handed to a ProxySession outside, started lazily

A run is a pipeline of three steps, each in its own module:

    plan(options, platform) -> RunPlan      egress.run.plan: decided, checked; nothing made
    prepare(plan) -> Prepared               egress.run.prepare: folders, the CA, the proxy's builder, files
    execute(prepared) -> status             egress.run.execute: sandbox, proxy, relay, signals

The sandbox is the platform's (sandbox/api.py's Platform: Linux namespaces and Landlock, macOS
Seatbelt, a container; elsewhere egress run refuses); nothing here depends on which.

Exit statuses: the command's own; 124 when --timeout expired (everything killed);
125 when egress run itself failed before the command started (bad policy, missing
project folder, sandbox refused); 126 not executable; 127 not found.
"""

from __future__ import annotations

import os
import sys

from egress.observe.terminal import say
from egress.run.execute import execute
from egress.run.options import LaunchError, RunOptions
from egress.run.plan import choose_provider, plan
from egress.run.prepare import prepare

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from sandbox.api import Platform

# RunOptions and LaunchError live in egress.run.options; named here too, for the CLI's callers
__all__ = ["LaunchError", "RunOptions", "main", "run"]


def run(options: RunOptions, platform: Platform | None = None) -> int:
    """Run the command; return its exit status (or a launcher status). Raises LaunchError.

    ``platform``: the sandbox to use (sandbox/platforms.py); None: --provider's, else this system's."""
    if platform is None:
        platform = choose_provider(options)
    if platform.warning:  # --provider local: said first, before anything else can scroll it away
        say(platform.warning)
    return execute(prepare(plan(options, platform)))


def main(options: RunOptions):
    """`egress run` for the command line (egress.cli, egress.entry): run; on a launcher failure
    its one-line reason and status; else exit with the command's status, at once."""
    try:
        status = run(options)
    except LaunchError as e:
        say(f"egress: {e}")
        sys.exit(e.status)
    # Everything the run made is gone (run cleans up before returning); skip the interpreter's
    # teardown, longer still once mitmproxy was loaded (bench/README.md, "Launcher": os._exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
