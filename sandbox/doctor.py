"""`egress doctor`: what isolation this machine really gives, one line per mechanism.

Each check runs the real mechanism where it can (the namespace check starts an
actual sandbox and hands its socket out) rather than guessing from versions.
Nothing is called "isolated" unless the command would be cut off from everything
but the proxy.

For tests and for rehearsing failures, ``EGRESS_DOCTOR_SIMULATE`` (comma-separated)
makes mechanisms look unavailable: ``no-userns``, ``no-landlock``, ``not-linux``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass

SIMULATE = "EGRESS_DOCTOR_SIMULATE"


@dataclass
class Check:
    name: str
    status: str  # ok | unavailable | not-applicable | warning
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok ", "unavailable": "NO ", "not-applicable": "-- ", "warning": "!! "}[self.status]
        text = f"{mark} {self.name:<18} {self.detail}"
        return text + (f"\n    fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict:
        return asdict(self)


def _simulated() -> set[str]:
    return {s.strip() for s in os.environ.get(SIMULATE, "").split(",") if s.strip()}


def _linux() -> bool:
    return sys.platform == "linux" and "not-linux" not in _simulated()


def check_namespaces() -> Check:
    name = "network namespace"
    if not _linux():
        return Check(name, "unavailable", "not Linux: egress run's namespaces need a Linux kernel",
                     "on macOS egress run will use a Seatbelt profile (not built yet)")
    if "no-userns" in _simulated():
        return Check(name, "unavailable", "user namespaces are refused (simulated)",
                     "sudo sysctl -w user.max_user_namespaces=15000")
    from sandbox.linux import SandboxError, SandboxSpec, start

    spec = SandboxSpec(argv=["true"], env={"PATH": "/usr/bin:/bin"}, cwd="/", network=True,
                       fs_confinement=False)
    try:
        with start(spec) as box:
            status = box.wait(30)
            handed_over = box.listen_socket is not None
    except SandboxError as e:
        reason, _, fix = str(e).partition("; fix: ")
        return Check(name, "unavailable", reason, fix)
    if status != 0 or not handed_over:
        return Check(name, "unavailable", f"a test sandbox did not run cleanly (status {status})")
    return Check(name, "ok", "isolated: each command gets its own user, PID and network namespace "
                             "holding only lo; the proxy's socket is its only road out")


def check_landlock() -> Check:
    name = "landlock"
    if not _linux():
        return Check(name, "not-applicable", "not Linux")
    if "no-landlock" in _simulated():
        return Check(name, "unavailable", "Landlock is missing (simulated): writes could not be confined",
                     "a kernel with Landlock (5.13+), or egress run --no-fs-confinement to accept unconfined writes")
    from sandbox import landlock

    abi = landlock.abi_version()
    if abi == 0:
        return Check(name, "unavailable", f"{landlock.unavailable_reason()}: writes could not be confined",
                     "egress run --no-fs-confinement to run with unconfined writes")
    return Check(name, "ok", f"writes confined to the project, --add-dir folders and a private "
                             f"temporary folder (Landlock ABI {abi})")


def check_seatbelt() -> Check:
    if sys.platform != "darwin":
        return Check("macos seatbelt", "not-applicable", "not macOS")
    return Check("macos seatbelt", "unavailable", "egress run does not support macOS yet",
                 "run egress serve and point clients at it; Seatbelt profiles are planned")


def check_local() -> Check:
    return Check("local", "warning", "always available, and not a sandbox: a command run without "
                                     "egress run can reach anything its user can")


def check_proxy(policies: list[str], state_dir) -> list[Check]:
    from egress.policy import PolicyError, load_policy
    from egress.state import ca_cert_path

    checks = []
    ca = ca_cert_path(state_dir)
    if ca.is_file():
        checks.append(Check("proxy CA", "ok", f"present: {ca} (clients trust it for intercepted TLS)"))
    else:
        checks.append(Check("proxy CA", "warning", f"not created yet: {ca}",
                            "egress ca path (or the first egress serve/run) creates it"))
    from egress.control import list_runs

    live = list_runs(state_dir)
    if live:
        names = ", ".join(r["run"] + (f" (metrics {r['metrics']})" if r.get("metrics") else "") for r in live)
        checks.append(Check("control sockets", "ok", f"reachable: {names}"))
    else:
        checks.append(Check("control sockets", "not-applicable", "no egress run or serve in progress"))
    try:
        policy = load_policy(policies or ["dev"])
    except PolicyError as e:
        checks.append(Check("policy", "unavailable", f"cannot be loaded: {e.problems[0]}",
                            "egress policy validate FILE lists every problem"))
    else:
        checks.append(Check("policy", "ok", f"valid: {policy.rule_count} entries from "
                                            f"{', '.join(policy.files)}"))
    return checks


def run_checks(policies: list[str], state_dir, fs_confinement: bool = True) -> tuple[list[Check], bool]:
    """Every check, and whether `egress run` (with these settings) can be honoured here."""
    namespaces, fs = check_namespaces(), check_landlock()
    checks = [namespaces, fs, check_seatbelt(), check_local(), *check_proxy(policies, state_dir)]
    honoured = namespaces.status == "ok" and (fs.status == "ok" or not fs_confinement)
    honoured = honoured and all(c.status != "unavailable" for c in checks if c.name == "policy")
    return checks, honoured
