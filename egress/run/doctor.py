"""`egress doctor`: what isolation this machine really gives, one line per mechanism.

Each check runs the real mechanism where it can (the namespace check starts an
actual sandbox and hands its socket out) rather than guessing from versions.
Nothing is called "isolated" unless the command would be cut off from everything
but the proxy.

For tests and for rehearsing failures, ``EGRESS_DOCTOR_SIMULATE`` (comma-separated)
makes mechanisms look unavailable: ``no-userns``, ``no-landlock``, ``not-linux``.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import asdict, dataclass

from egress.core.contract import PROXY_MODE_ENV
from egress.policy.source import PolicySource
from egress.proxy.ca import ca_cert_path
from sandbox.spec import SandboxError, SandboxSpec

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
                     "on macOS egress run uses a Seatbelt profile instead; elsewhere use egress serve")
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


# Run inside a real sandbox by check_protections: each attempt a hostile command would make.
_PROBE = r"""
import ctypes, errno, fcntl, json, os, pty, signal, socket, sys, termios
hidden, caller_group = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)

def raw(number, *args):  # a system call's errno, or "ok"
    if libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args]) == -1:
        return ctypes.get_errno()
    return "ok"

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return e.errno

def inject():
    master, slave = pty.openpty()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        code = attempt(lambda: fcntl.ioctl(slave, termios.TIOCSTI, b" "))
        os._exit(0 if code == "ok" else code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) or "ok"

status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({
    "tiocsti": inject(),
    "chmod": attempt(lambda: os.chmod("/", os.stat("/").st_mode & 0o7777)),  # the same mode: harmless if it passed
    "masked": {d: sorted(os.listdir(d)) for d in ("/tmp", "/var/tmp", "/run") if os.path.isdir(d)},
    "hidden": sorted(os.listdir(hidden)),
    "shm": os.stat("/dev/shm").st_dev if os.path.isdir("/dev/shm") else None,
    "capabilities": status.get("CapBnd", "").strip() + status.get("CapEff", "").strip(),
    # signal 0: checks whether a signal would be delivered, and delivers none
    "signal caller": attempt(lambda: os.killpg(caller_group, 0)),
    "session": [os.getsid(0), os.getpgrp()],
    "empty": {d: sorted(os.listdir(d)) for d in ("/home", "/srv", "/mnt", "/media", "/root") if os.path.isdir(d)},
    "dev": sorted(os.listdir("/dev")),
    "keyctl": raw({"x86_64": 250, "aarch64": 219, "riscv64": 219}.get(os.uname().machine, 250), 0, -4, 0),
    "vsock": attempt(lambda: socket.socket(40, socket.SOCK_STREAM).close()),
    "clone3": raw(435, 0, 0),
    "setuid": attempt(lambda: (open("su", "w").close(), os.chmod("su", 0o4755))),
    "hook": attempt(lambda: open(".git/hooks/pre-commit", "w").close()),
}))
"""


def check_protections() -> list[Check]:
    """Each wall issue 8's review tested, tried from inside a real sandbox on this machine."""
    import json
    import shutil
    import tempfile

    from sandbox.linux import SandboxError, SandboxSpec, start

    names = ("tty injection", "host files", "unix sockets", "egress state", "shared memory", "capabilities",
             "signals", "terminals", "keyrings", "socket families", "cgroups", "set-id files", "later-run files")
    work = tempfile.mkdtemp(prefix="egress-doctor-")
    try:
        hidden = os.path.join(work, "state")
        os.makedirs(os.path.join(hidden, "runs"))
        os.makedirs(os.path.join(work, ".git", "hooks"))  # a repository's hooks: read-only inside
        read, write = os.pipe()
        try:
            box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", _PROBE, hidden, str(os.getpgrp())],
                                    {"PATH": "/usr/bin:/bin"}, work, writable=[work], network=False, hidden=[hidden],
                                    stdout=write))
        except SandboxError as e:
            return [Check(name, "unavailable", f"a probe sandbox could not start: {e}") for name in names]
        finally:
            os.close(write)
        with box, os.fdopen(read) as out:
            status = box.wait(30)
            text = out.read()
        try:
            seen = json.loads(text)
        except ValueError:
            return [Check(name, "unavailable", f"the probe failed (status {status})") for name in names]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    legacy = _read("/proc/sys/dev/tty/legacy_tiocsti")
    kernel = {"1": "the kernel lets a process type into its controlling terminal (dev.tty.legacy_tiocsti = 1)",
              "0": "the kernel refuses it too (dev.tty.legacy_tiocsti = 0)"}.get(legacy, "dev.tty.legacy_tiocsti unknown")
    checks = [
        _wall("tty injection", seen["tiocsti"] == errno.EPERM,
              f"TIOCSTI and TIOCLINUX refused by egress's seccomp filter; {kernel}",
              f"TIOCSTI was not refused ({seen['tiocsti']}); {kernel}"),
        _wall("host files", seen["chmod"] == errno.EROFS,
              "the host is read-only inside: no write, chmod, chown, utime or xattr outside the writable folders",
              f"chmod on the host was not refused with EROFS ({seen['chmod']})"),
    ]
    # The probe's own (writable) folder and the interpreter's trees are put back inside the
    # masks, read-only; anything else is a leak.
    exposed = [os.path.realpath(p) for p in [work, *SandboxSpec(["true"], {}, "/").readable]]
    leftovers = {d: [n for n in entries
                     if not any(p == os.path.join(d, n) or p.startswith(os.path.join(d, n) + "/") for p in exposed)]
                 for d, entries in {**seen["masked"], **seen["empty"]}.items()}
    leftovers = {d: entries for d, entries in leftovers.items() if entries}
    checks.append(_wall("unix sockets", not leftovers,
                        "the command's filesystem is an allow list (system folders, toolchains, the project, "
                        "--add-dir and --read): no host socket elsewhere is there to connect to, whatever "
                        "namespace bound it; sockets inside granted folders are covered at each run's start",
                        f"folders outside the grants show {leftovers}"))
    checks.append(_wall("egress state", seen["hidden"] == [],
                        "egress's state folder (each run's socket, the CA's key) is hidden from commands, "
                        "and those sockets refuse peers inside sandboxes",
                        f"the state folder shows {seen['hidden']}"))
    host_shm = os.stat("/dev/shm").st_dev if os.path.isdir("/dev/shm") else None
    checks.append(_wall("shared memory", seen["shm"] is None or seen["shm"] != host_shm,
                        "each command gets a private /dev/shm", "/dev/shm is the host's"))
    checks.append(_wall("capabilities", set(seen["capabilities"]) <= {"0"},
                        "commands hold no capability, even when the caller is root",
                        f"capabilities remain ({seen['capabilities']})"))
    from sandbox import landlock

    scoped = landlock.abi_version() >= landlock.SCOPES_ABI
    layers = ("a process group and session of its own, and Landlock's signal scope (ABI 6)" if scoped else
              "a process group and session of its own (this kernel has no Landlock signal scope: Linux 6.12+)")
    checks.append(_wall("signals", seen["signal caller"] in (errno.ESRCH, errno.EPERM) and seen["session"] == [1, 1],
                        f"the command signals nothing outside its run: {layers}",
                        f"the command could signal egress's process group ({seen['signal caller']}, "
                        f"session {seen['session']})"))
    from sandbox.mounts import DEVICE_NAMES

    allowed_dev = {*DEVICE_NAMES, "console", "fd", "stdin", "stdout", "stderr", "ptmx", "pts", "shm"}
    checks.append(_wall("terminals", set(seen["dev"]) <= allowed_dev,
                        "/dev holds the ordinary devices, the command's own ptys and its own terminal: no other "
                        "terminal of yours, no /dev/vsock, /dev/kvm or /dev/log",
                        f"/dev shows more: {sorted(set(seen['dev']) - allowed_dev)}"))
    checks.append(_wall("keyrings", seen["keyctl"] == errno.EPERM,
                        "keyctl, add_key and request_key are refused: no keyring of yours is read, planted or revoked",
                        f"keyctl was not refused ({seen['keyctl']})"))
    checks.append(_wall("socket families", seen["vsock"] in (errno.EAFNOSUPPORT, errno.EPERM),
                        "only Unix, IPv4, IPv6 and netlink-route sockets can be made (no AF_VSOCK to the hypervisor)",
                        f"an AF_VSOCK socket could be made ({seen['vsock']})"))
    checks.append(_wall("cgroups", seen["clone3"] == errno.ENOSYS,
                        "clone3 is refused (libc falls back to clone): no process can be started in another cgroup",
                        f"clone3 was not refused ({seen['clone3']})"))
    checks.append(_wall("set-id files", seen["setuid"] == errno.EPERM,
                        "no set-user-id or set-group-id file can be made, whoever the caller is",
                        f"chmod 4755 was not refused ({seen['setuid']})"))
    checks.append(_wall("later-run files", seen["hook"] == errno.EROFS,
                        "git hooks and config, .gitmodules, editor and agent folders and .envrc of the project are "
                        "read-only inside (egress run --allow-hooks lifts it); made anew, they are moved aside",
                        f"a git hook could be written ({seen['hook']})"))
    return checks


def _wall(name: str, holds: bool, detail: str, failure: str) -> Check:
    return Check(name, "ok", detail) if holds else Check(name, "unavailable", failure)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def check_seatbelt(platform=None) -> Check:
    """macOS: sandbox-exec is there, runs a trivial profile, and runs egress's own profile (so this
    macOS reads every rule egress writes)."""
    name = "macos seatbelt"
    if platform is None or platform.name != "darwin":
        return Check(name, "not-applicable", "not macOS")
    refusal = platform.refusal()
    if refusal is not None:
        return Check(name, "unavailable", refusal, "egress serve, with clients pointed at it, is all that works here")
    import subprocess

    trivial = subprocess.run([platform.sandbox_exec, "-p", "(version 1)(allow default)", "/usr/bin/true"],
                             capture_output=True, text=True, timeout=60)
    if trivial.returncode != 0:
        return Check(name, "unavailable", f"sandbox-exec refused a trivial profile (status {trivial.returncode}: "
                                          f"{_first_line(trivial.stderr)})")
    problem = _run_own_profile(platform)
    if problem is not None:
        return Check(name, "unavailable", f"sandbox-exec refused egress's profile: {problem}",
                     "report it with `sw_vers` and egress's version: this macOS reads the profile differently")
    return Check(name, "ok", "isolated: sandbox-exec runs egress's profile; each command reaches only its run's "
                             "proxy (127.0.0.1, a port and a secret made for the run), no DNS, and writes only to "
                             "the project, --add-dir folders and a private temporary folder")


def _run_own_profile(platform) -> str | None:
    """Run /usr/bin/true under the profile egress run would write; None if it ran, else why not."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="egress-doctor-")
    listener = None
    try:
        listener = platform.listener(True)
        read, write = os.pipe()
        try:
            spec = SandboxSpec(["/usr/bin/true"], {"PATH": "/usr/bin:/bin"}, work, writable=[work],
                               proxy_port=listener.port, socket_dirs=[work], stderr=write,
                               hidden=[os.path.join(work, "state")])
            box = platform.start(spec, listener)
            listener = None
        except SandboxError as e:
            return str(e)
        finally:
            os.close(write)
        with box, os.fdopen(read) as err:
            status = box.wait(30)
            said = err.read()
        return None if status == 0 else f"status {status}: {_first_line(said)}"
    except OSError as e:
        return str(e)
    finally:
        if listener is not None:
            listener.close()
        shutil.rmtree(work, ignore_errors=True)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["no message"])[0][:200]


def macos_promises() -> list[Check]:
    """What the Seatbelt profile holds on macOS, and what it does not (docs/architecture.md)."""
    return [
        Check("host files", "ok", "writes outside the writable folders are refused (chmod, rename and unlink "
                                  "included); egress's own code inside them stays read-only"),
        Check("unix sockets", "ok", "only inside the run's own folder: every other socket (docker, ssh-agent, "
                                    "egress's own) is refused, and no other service but a short list of system ones"),
        Check("egress state", "ok", "egress's state folder (the CA's key, control sockets) is unreadable to "
                                    "commands, and control sockets answer only processes outside sandboxes"),
        Check("tty injection", "warning", "not refused on macOS: a command can type into the terminal it shares "
                                          "(TIOCSTI); run untrusted commands without a terminal (egress run ... "
                                          "< /dev/null > log 2>&1)"),
        Check("later-run files", "ok", "git hooks and config, .gitmodules, editor and agent folders, .mcp.json "
                                       "and .envrc at the top of each writable tree are unwritable under any "
                                       "spelling, .git cannot be moved (--allow-hooks lifts it)"),
        Check("code and sysctls", "ok", "no sysctl is written and only named facts are read (no other process's "
                                        "arguments or environment); code is mapped only from the system, installed "
                                        "toolchains, the run's interpreter and PATH, and the writable trees"),
        Check("process tree", "warning", "--timeout and the run's end kill the command's process group; a process "
                                         "that leaves it (setsid, a daemon) outlives the run, still sandboxed, "
                                         "its proxy gone"),
    ]


def check_local() -> Check:
    return Check("local", "warning", "always available, and not a sandbox: a command run without "
                                     "egress run, or with --provider local, can reach anything its user can "
                                     "and write wherever its user may",
                 "use a sandboxing provider (namespace, the default on Linux) for commands you do not trust")


def check_providers(namespaces: Check | None = None, fs: Check | None = None) -> list[Check]:
    """What each `egress run --provider` gives here, in words that do not overclaim
    (sandbox/providers.py). ``namespaces``, ``fs``: the namespace and Landlock checks already run."""
    checks = []
    if namespaces is not None:
        if namespaces.status == "ok":
            writes = ("writes confined" if fs is not None and fs.status == "ok" else
                      "writes NOT confined (no Landlock: only with --no-fs-confinement)")
            checks.append(Check("provider namespace", "ok" if fs is not None and fs.status == "ok" else "warning",
                                f"own network and {writes}; shares this kernel (the default)",
                                "" if fs is not None and fs.status == "ok" else fs.fix if fs else ""))
        else:
            checks.append(Check("provider namespace", "unavailable", namespaces.detail, namespaces.fix))
    checks.append(_container_provider("podman"))
    checks.append(_container_provider("docker"))
    return checks


def _container_provider(engine: str) -> Check:
    import shutil

    name = f"provider {engine}"
    if not _linux():
        return Check(name, "not-applicable", "not Linux: the container joins a network namespace egress makes")
    path = shutil.which(engine)
    if path is None:
        return Check(name, "not-applicable", f"{engine} is not installed",
                     "apt-get install podman (egress runs it as root: rootless podman cannot join its "
                     "namespace)" if engine == "podman"
                     else "install docker, or prefer podman")
    from sandbox import container_seccomp

    missing = container_seccomp.refusal(engine)
    if missing is not None:
        return Check(name, "unavailable", missing,
                     "apt-get install golang-github-containers-common (Debian, Ubuntu), containers-common elsewhere")
    if engine == "docker":
        return _docker(name, path)
    if os.geteuid() == 0:
        return Check(name, "warning", "kernel isolation and egress's network namespace, but an escape lands "
                                      f"on root (podman run as root); {_container_walls()}",
                     "for commands you do not trust, --provider namespace confines them without root "
                     "(rootless podman cannot join egress's namespace)")
    from sandbox.container import ROOTLESS_FIX, ROOTLESS_REASON

    return Check(name, "unavailable", f"egress run refuses it: {ROOTLESS_REASON}", ROOTLESS_FIX)


def _container_walls() -> str:
    from sandbox import container_seccomp, idmap

    return (f"egress's seccomp profile on {container_seccomp.default_profile()} (keyrings, socket families but "
            "unix/inet/inet6/netlink-route, clone3, new namespaces, io_uring and set-id modes refused); runs as "
            f"uid {idmap.container_ids()[0]}, no account here; project and :rw mounts nosuid")


def _docker(name: str, path: str) -> Check:
    """What is true of --provider docker here, from the daemon's own answer; doctor starts no container."""
    import subprocess

    from sandbox.container import EngineNamespace

    try:
        answer = subprocess.run([path, "info", "--format", "{{.ServerVersion}}|{{json .SecurityOptions}}"],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        answer = subprocess.CompletedProcess([], 1, "", str(e))
    version, _, options = answer.stdout.strip().partition("|")
    if answer.returncode != 0 or not version:
        return Check(name, "unavailable", "no docker daemon answers (DOCKER_HOST, else /var/run/docker.sock)",
                     "start the docker daemon, or use --provider podman (no daemon)")
    daemon = ("a rootless daemon: an escape lands on the user who runs it" if "rootless" in options else
              "a root daemon: whoever can use it is root here, and an escape lands on root")
    refusal = EngineNamespace.refusal()
    if refusal is not None:
        return Check(name, "unavailable", f"the daemon answers (version {version}, {daemon}), but {refusal}",
                     "sudo egress run --provider docker ..., or --provider podman")
    return Check(name, "warning", f"the daemon answers (version {version}, {daemon}); egress sets up the "
                                  "network namespace of a holder container from inside and the command's container "
                                  f"joins it; {_container_walls()}; not tried by egress doctor (it starts no "
                                  "container)",
                 "prefer --provider namespace (no daemon, no root)")


def check_proxy(policies: list[str], state_dir, warm: bool = True) -> list[Check]:
    from egress.policy.loader import PolicyError

    checks = []
    ca = ca_cert_path(state_dir)
    if os.path.isfile(ca):
        checks.append(Check("proxy CA", "ok", f"present: {ca} (clients trust it for intercepted TLS)"))
    else:
        checks.append(Check("proxy CA", "warning", f"not created yet: {ca}",
                            "egress ca path (or the first egress serve/run) creates it"))
    from egress.host.control import list_runs

    live = list_runs(state_dir)
    if live:
        names = ", ".join(r["run"] + (f" (metrics {r['metrics']})" if r.get("metrics") else "") for r in live)
        checks.append(Check("control sockets", "ok", f"reachable: {names}"))
    else:
        checks.append(Check("control sockets", "not-applicable", "no egress run or serve in progress"))
    checks.append(check_warm_proxy(state_dir) if warm else Check(
        "warm proxy", "not-applicable", "Linux only: here each egress run starts its own proxy when its command "
                                        "first connects (~0.6 s)"))
    try:
        policy = PolicySource(policies).load()  # as serve loads them: the built-in set without any
    except PolicyError as e:
        checks.append(Check("policy", "unavailable", f"cannot be loaded: {e.problems[0]}",
                            "egress policy validate FILE lists every problem"))
    else:
        checks.append(Check("policy", "ok", f"valid: {policy.size} from "
                                            f"{', '.join(policy.files)}"))
    return checks


def check_warm_proxy(state_dir) -> Check:
    """The per-user warm proxy egress run hands its sandbox's socket to (egress.run.warm.client)."""
    import time

    from egress.run.warm import client as warm

    name = "warm proxy"
    if os.environ.get(PROXY_MODE_ENV) == "lazy":
        return Check(name, "not-applicable", f"off (${PROXY_MODE_ENV}=lazy): each egress run starts its own "
                                             f"proxy when its command first connects (~0.5 s)")
    try:
        paths = warm.Paths.for_state(state_dir)
    except OSError as e:
        return Check(name, "warning", f"cannot tell: {e}")
    info = warm.read_info(paths)
    idle = f"{info['idle']:g}" if info else f"{warm.idle_seconds():g}"
    if info is None:
        return Check(name, "not-applicable", f"not running; the next networked egress run starts it in the "
                                             f"background (it exits after {idle} s without a run)")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
    return Check(name, "ok", f"running: pid {info['pid']} since {since}, exits after {idle} s without a run; "
                             f"each egress run's proxy is a child of it ({paths.socket})")


def run_checks(policies: list[str], state_dir, fs_confinement: bool = True,
               platform=None) -> tuple[list[Check], bool]:
    """Every check, and whether `egress run` (with these settings) can be honoured here.

    ``platform``: the sandbox to judge (sandbox/platforms.py); None: this system's."""
    if platform is None:
        from sandbox.platforms import current

        platform = current()
    policy_ok = lambda checks: all(c.status != "unavailable" for c in checks if c.name == "policy")  # noqa: E731
    if platform.name == "darwin":
        seatbelt = check_seatbelt(platform)
        promises = macos_promises() if seatbelt.status == "ok" else []
        checks = [seatbelt, *promises, check_local(), *check_proxy(policies, state_dir, warm=platform.warm)]
        return checks, seatbelt.status == "ok" and policy_ok(checks)
    if not platform.name.startswith("linux"):
        # No warm proxy row: it is Linux's, and egress.run.warm.client needs fcntl, which Windows lacks.
        proxy = [c for c in check_proxy(policies, state_dir, warm=False) if c.name != "warm proxy"]
        checks = [Check("os sandbox", "unavailable", platform.refusal(),
                        "egress serve, with clients pointed at it, is all that works here"),
                  check_local(), *proxy]
        return checks, False
    namespaces, fs = check_namespaces(), check_landlock()
    walls = check_protections() if namespaces.status == "ok" and fs.status == "ok" else []
    checks = [namespaces, fs, *walls, check_seatbelt(), *check_providers(namespaces, fs), check_local(),
              *check_proxy(policies, state_dir)]
    honoured = namespaces.status == "ok" and (fs.status == "ok" or not fs_confinement)
    honoured = honoured and all(c.status == "ok" for c in walls)
    return checks, honoured and policy_ok(checks)
