"""`egress run --provider`: local (no sandbox, said first), podman and docker (a hardened container
in a network namespace egress set up), and egress doctor's words for each. What every provider
promises alike (the exit status, the only road out, confined writes, signals, the end) is
tests/sandbox/test_conformance.py's, which starts these engines through this file's fixtures.

The container tests run each behaviour on both engines for real: a rootful podman, and a dockerd
of the test's own (its own socket and folders, stopped by its pid), with an image imported from
a tarball made here (a static busybox, and curl with its libraries copied from this machine: no
registry). This machine's engine settings (runc, cgroupfs, no default ulimits, vfs:
../shared/research) go in the engine's own configuration (CONTAINERS_CONF, dockerd's flags),
never in egress's.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import clean_env, egress_command
from test_run import POLICY, egress_run, nobody_home, test_host  # noqa: F401 (fixtures)

from sandbox import container as ct
from sandbox.providers import PROVIDERS, select

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the providers are tested on Linux")

IMAGE = "localhost/egress-provider-test:1"


# ------------------------------------------------------------------ pure: flags and names


@pytest.mark.parametrize("text, expected", [
    ("/etc:/host-etc", ("/etc", "/host-etc", False)),
    ("/etc:/host-etc:ro", ("/etc", "/host-etc", False)),
    ("/etc:/host-etc:rw", ("/etc", "/host-etc", True)),
    ("/etc:/a/../b", ("/etc", "/b", False)),
])
def test_mounts_are_read_only_unless_rw_is_written(text, expected):
    assert ct.parse_mount(text) == expected


@pytest.mark.parametrize("text", ["/etc", "/etc:relative", "/etc:/x:rwx", "/no/such/dir:/x", "/etc:/x,y", ":/x"])
def test_malformed_mounts_are_refused(text):
    with pytest.raises(ValueError):
        ct.parse_mount(text)


def test_every_container_gets_the_whole_hardening_list_whatever_was_asked(tmp_path):
    from sandbox.spec import SandboxSpec

    spec = SandboxSpec(["id"], {"HTTPS_PROXY": "http://127.0.0.1:3128", "SSL_CERT_FILE": "/x/ca.pem",
                                "AWS_SECRET_ACCESS_KEY": "from-the-caller"}, str(tmp_path))
    ways = {"podman": ["--network", "ns:/proc/1/ns/net"],
            "docker": ["--network", "container:h", "--pid", "container:h"]}
    for (engine, network), chosen in itertools.product(ways.items(), (
            ct.ContainerSpec("img"), ct.ContainerSpec("img", [f"{tmp_path}:/data:rw"], ["cache"], "1", "64m"))):
        argv = ct.engine_argv(engine, "egress-x", network, spec, chosen, "/x/ca.pem", user=2000000000,
                              profile="/v/seccomp.json", writable={str(tmp_path): "/v/rw0"})
        text = " ".join(argv)
        assert " ".join(ct.HARDENING) in text  # the same list for both engines
        assert "--cap-drop ALL" in text and "--security-opt no-new-privileges" in text
        assert "--security-opt seccomp=/v/seccomp.json --user 2000000000:2000000000" in text
        assert f"--memory {chosen.memory} --memory-swap {chosen.memory}" in text
        assert " ".join(network) in text
        assert f"type=bind,src={tmp_path},dst=/work " in text + " "
        assert f"src=/x/ca.pem,dst={ct.CA_PATH},ro" in text
        assert "AWS_SECRET_ACCESS_KEY" not in text  # the caller's environment stays outside
        assert argv[-2:] == ["img", "id"] and argv[-3] == "--"
        if chosen.persist:  # a writable mount through its nosuid view; podman's volume nosuid too
            assert "type=bind,src=/v/rw0,dst=/data " in text + " "
            assert ("--volume cache:/persist/cache:U,nosuid" if engine == "podman" else
                    "--volume cache:/persist/cache") in text


def test_the_containers_user_and_the_holders_are_no_accounts_of_this_host(tmp_path):
    """N5: the fixed 1000 was the host's first user (whose user keyring the container read). The
    ids skip the user database, subordinate ranges, and ids a process of this PID namespace runs with."""
    import grp

    from sandbox import idmap

    user, holder = idmap.container_ids()
    assert idmap.FIRST_ID <= user < holder < 2**31 and ct.hardening(holder, "/p")[-1] == f"{holder}:{holder}"
    for uid in (user, holder):
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)
        with pytest.raises(KeyError):
            grp.getgrgid(uid)
    nobody = pwd.getpwnam("nobody").pw_uid
    assert idmap.container_ids(1, first=nobody) != [nobody]  # an account: skipped
    if os.geteuid() == 0:  # a process running as the first id: skipped while it runs
        sleeper = subprocess.Popen(["sleep", "60"], user=user, group=user, extra_groups=[])
        try:
            while str(user) not in open(f"/proc/{sleeper.pid}/status").read():
                time.sleep(0.01)
            assert user not in idmap.container_ids()
        finally:
            sleeper.kill()
            sleeper.wait()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the holder program is x86_64 code")
def test_the_holder_program_waits_until_its_stdin_closes(tmp_path):
    from sandbox import holder

    program = tmp_path / "hold"
    program.write_bytes(holder.program())
    program.chmod(0o555)
    read, write = os.pipe()
    process = subprocess.Popen([str(program)], stdin=read)
    os.close(read)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(1.5)  # past one poll period: still waiting
    finally:
        os.close(write)
    assert process.wait(60) == 0
    assert subprocess.run([str(program)], stdin=subprocess.DEVNULL).returncode == 0  # nothing to hold: ends


def test_unknown_provider_and_container_flags_without_a_container_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--provider must be one of"):
        select("vm")
    assert set(PROVIDERS) == {"namespace", "seatbelt", "podman", "docker", "local"}
    result = subprocess.run([*egress_command(), "run", "--image", "x", "--", "true"], capture_output=True,
                            text=True, env=clean_env(tmp_path), cwd=tmp_path, timeout=60)
    assert result.returncode == 125 and "for --provider podman or docker" in result.stderr
    result = subprocess.run([*egress_command(), "run", "--provider", "podman", "--", "true"], capture_output=True,
                            text=True, env=clean_env(tmp_path), cwd=tmp_path, timeout=60)
    assert result.returncode == 125 and "needs an image" in result.stderr


def test_covers_keep_the_namespace_providers_promises_wherever_a_mount_shows_the_path(tmp_path):
    from sandbox.spec import SandboxSpec

    project, data = tmp_path / "project", tmp_path / "data"
    for folder in (project / "state", project / "lib" / "egress", data):
        folder.mkdir(parents=True)
    for secret in (project / ".token", data / "key", tmp_path / "elsewhere"):
        secret.write_text("s")
    spec = SandboxSpec(["true"], {"GITHUB_TOKEN": "ghp_placeholder", "OTHER_TOKEN": "real"}, str(project),
                       hidden=[str(project / "state")], read_only=[str(project / "lib" / "egress")],
                       replaced={str(p): b"" for p in (project / ".token", data / "key", tmp_path / "elsewhere",
                                                        project / "state" / "in-hidden")},
                       placeholders=["GITHUB_TOKEN"])
    chosen = ct.ContainerSpec("img", [f"{data}:/data:rw", f"{project}:/again"])
    shown = {path: f"/stand-in/{i}" for i, path in enumerate(sorted(spec.replaced))}
    assert ct.covers(spec, chosen, shown, work="/view/work") == [
        # the folder on the way to the code in the writable /work, pinned from the owner-mapped view
        "type=bind,src=/view/work/lib,dst=/work/lib",
        "type=tmpfs,dst=/work/state,ro,tmpfs-size=4096", "type=tmpfs,dst=/again/state,ro,tmpfs-size=4096",
        f"type=bind,src={project}/lib/egress,dst=/work/lib/egress,ro",
        f"type=bind,src={project}/lib/egress,dst=/again/lib/egress,ro",
        f"type=bind,src={shown[str(data / 'key')]},dst=/data/key,ro",
        # outside every mount: where the namespace provider shows it, its own path
        f"type=bind,src={shown[str(tmp_path / 'elsewhere')]},dst={tmp_path}/elsewhere,ro",
        f"type=bind,src={shown[str(project / '.token')]},dst=/work/.token,ro",
        f"type=bind,src={shown[str(project / '.token')]},dst=/again/.token,ro",
    ]  # (the file inside the hidden folder is hidden with it)
    env = ct.container_environment(spec.env, spec.placeholders)
    assert env["GITHUB_TOKEN"] == "ghp_placeholder" and "OTHER_TOKEN" not in env


# ------------------------------------------------------------------ local


def test_local_says_first_it_is_no_sandbox_and_still_reports_refusals(tmp_path, http_upstream):
    script = "curl -sS -o /dev/null -w '%{http_code} ' " + http_upstream.url("allowed.test") + \
             "; curl -sS -o /dev/null -w '%{http_code}' http://blocked.invalid/"
    result = egress_run(tmp_path, "sh", "-c", script, extra=["--provider", "local"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "200 403"
    assert result.stderr.splitlines()[0].startswith("egress: --provider local is NOT a sandbox")
    assert "EGRESS_BLOCKED blocked.invalid (not on the allow list)" in result.stderr


def test_doctor_names_each_provider_without_overclaiming(tmp_path):
    result = subprocess.run([*egress_command(), "doctor", "--json"], capture_output=True, text=True, timeout=120,
                            env=clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state")))
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert "own network and writes confined; shares this kernel" in rows["provider namespace"]["detail"]
    assert "not a sandbox" in rows["local"]["detail"] and rows["local"]["fix"]
    podman = rows["provider podman"]
    if shutil.which("podman") and os.geteuid() == 0:
        assert podman["status"] == "warning" and "an escape lands on root" in podman["detail"]
        assert "--provider namespace" in podman["fix"]
    docker = rows["provider docker"]
    assert docker["status"] != "ok" and docker["fix"]  # a root daemon, or none: never plainly ok
    for row in rows.values():
        if row["name"].startswith("provider") or row["name"] == "local":
            assert "isolated" not in row["detail"]


# ------------------------------------------------------------------ real engines: podman and docker


class Engine(NamedTuple):
    name: str  # podman | docker: egress run --provider NAME
    env: dict  # the engine's own variables (CONTAINERS_CONF, DOCKER_HOST), for egress and the test alike
    image: str

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([self.name, *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **self.env}, **kwargs)

    def containers(self) -> list[str]:
        """Every container the engine knows of, running or not (tests leave none)."""
        return self.run("ps", "--all", "--format", "{{.Names}}").stdout.split()


@pytest.fixture(scope="module")
def image_tarball(tmp_path_factory):
    """A root filesystem as a tarball for `ENGINE import`: a static busybox, and curl with its
    libraries copied from this machine (no registry is reachable)."""
    curl = shutil.which("curl")
    if not os.path.exists("/bin/busybox") or curl is None:
        pytest.skip("busybox-static and curl are needed for the test image (scripts/test installs them as root)")
    work = tmp_path_factory.mktemp("image")
    root = work / "root"
    for folder in ("bin", "etc", "tmp", "work", "persist"):
        (root / folder).mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "ls", "echo", "cat", "id", "seq", "sleep", "head", "tail", "touch", "ping", "wc", "true",
                   "kill", "nslookup", "nc", "ip", "tr", "stat", "mkdir", "mv", "rmdir", "chmod", "grep"):
        (root / "bin" / applet).symlink_to("busybox")
    shutil.copy(curl, root / "bin" / "curl")
    libraries = subprocess.run(["ldd", curl], capture_output=True, text=True, check=True).stdout
    for token in libraries.split():
        if token.startswith("/"):
            target = root / token.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(token, target)
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    tarball = work / "root.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
    return tarball


def _import_and_probe(engine: Engine, tarball) -> None:
    made = engine.run("import", str(tarball), engine.image)
    if made.returncode != 0:
        pytest.skip(f"{engine.name} cannot import an image here: {made.stderr.strip()[:200]}")
    probe = engine.run("run", "--rm", "--network", "none", engine.image, "true")
    if probe.returncode != 0:
        pytest.skip(f"{engine.name} cannot run a container here: {probe.stderr.strip()[:200]}")


@pytest.fixture(scope="module")
def podman(tmp_path_factory, image_tarball):
    """A real rootful podman with a store of its own; this machine's settings (runc, cgroupfs, no
    default ulimits: ../shared/research) in a containers.conf named by CONTAINERS_CONF, never in
    egress's flags."""
    runc = shutil.which("runc") or ("/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else None)
    if shutil.which("podman") is None or runc is None:
        pytest.skip("podman and runc are needed (scripts/test installs them as root)")
    if os.geteuid() != 0:
        pytest.skip("podman is tested rootful here (an unprivileged podman cannot join egress's namespace)")
    work = tmp_path_factory.mktemp("podman")
    conf = work / "containers.conf"
    conf.write_text(f'[containers]\ndefault_ulimits = []\n[engine]\nruntime = "{runc}"\ncgroup_manager = "cgroupfs"\n')
    # A store of its own (the machine's is shared): `podman ps` then shows this module's containers only.
    # The run root's path must stay under 50 characters: past that, the `podman container cleanup`
    # that conmon starts when a container ends fails ("the specified runroot is longer than 50
    # characters"), and `podman run --rm` waits 20 s before it cleans up itself. Under pytest-xdist's
    # popen-gwN/ folders that cost every podman test ~20 s (a 2-s test took 22).
    runroot = tempfile.mkdtemp(prefix="egress-podman-", dir="/tmp")
    storage = work / "storage.conf"
    storage.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/graph"\nrunroot = "{runroot}"\n')
    engine = Engine("podman", {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}, IMAGE)
    try:
        _import_and_probe(engine, image_tarball)
        yield engine
    finally:
        for name in engine.containers():
            engine.run("rm", "--force", name)
        engine.run("rmi", "--force", IMAGE)
        shutil.rmtree(runroot, ignore_errors=True)


@pytest.fixture(scope="module")
def docker(image_tarball):
    """A real Docker Engine: a dockerd of the test's own, on its own socket, data and exec folders
    (Debian's docker.io; its packaged service is never started), stopped by its pid at the end.
    This machine's settings: no iptables or bridge (the containers need none), the cgroupfs driver
    (hybrid cgroups), vfs storage (works on any filesystem)."""
    dockerd = shutil.which("dockerd")
    if dockerd is None or shutil.which("docker") is None:
        pytest.skip("dockerd (Debian's docker.io) and the docker client are needed (scripts/test installs "
                    "docker.io as root)")
    if os.geteuid() != 0:
        pytest.skip("dockerd runs as root, and egress must be root to enter the namespaces Docker makes")
    work = tempfile.mkdtemp(prefix="egress-dockerd-", dir="/tmp")  # short: a socket path has 108 bytes
    sock = os.path.join(work, "docker.sock")
    log = open(os.path.join(work, "dockerd.log"), "w+")
    daemon = subprocess.Popen([dockerd, "--host", f"unix://{sock}", "--data-root", f"{work}/data",
                               "--exec-root", f"{work}/exec", "--pidfile", f"{work}/dockerd.pid",
                               "--iptables=false", "--ip6tables=false", "--bridge=none",
                               "--exec-opt", "native.cgroupdriver=cgroupfs", "--storage-driver", "vfs"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine("docker", {"DOCKER_HOST": f"unix://{sock}"}, IMAGE)
    try:
        for _ in range(600):  # the daemon answers, or has said why not
            if daemon.poll() is not None or engine.run("version").returncode == 0:
                break
            time.sleep(0.1)
        if daemon.poll() is not None or engine.run("version").returncode != 0:
            log.seek(0)
            pytest.skip(f"dockerd cannot run here: {' | '.join(log.read().strip().splitlines()[-3:])[:400]}")
        _import_and_probe(engine, image_tarball)
        yield engine
    finally:
        for name in engine.containers() if daemon.poll() is None else []:
            engine.run("rm", "--force", name)
        daemon.terminate()  # dockerd stops the containerd it started
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        _unmount_under(work)  # what a killed daemon may leave: its namespaces' bind mounts
        shutil.rmtree(work, ignore_errors=True)


def _unmount_under(folder: str) -> None:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(folder + "/")), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


@pytest.fixture(scope="module", params=["podman", "docker"])
def engine(request) -> Engine:
    return request.getfixturevalue(request.param)


# The projects' owner: not root, not the container's user, and in the user database (egress maps
# the owner's own groups only, so it must know them)
OWNER, OWNER_GROUP = pwd.getpwnam("nobody").pw_uid, pwd.getpwnam("nobody").pw_gid


def container_user() -> int:
    """The uid (and gid) egress runs the command's container as here: no account of this host."""
    from sandbox import idmap

    return idmap.container_ids()[0]


def make_project(tmp_path) -> Path:
    """The run's project, owned by OWNER: the container's user writes there as its owner."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    os.chown(project, OWNER, OWNER_GROUP)
    return project


def in_container(tmp_path, engine: Engine, *command, extra=(), policy=None, timeout=180, upstream_ca=None,
                 env=None):
    project = make_project(tmp_path)
    kwargs = {"policy": policy} if policy else {}
    return egress_run(tmp_path, *command, extra=["--provider", engine.name, "--image", engine.image, *extra],
                      project=project, env={**engine.env, **(env or {})}, timeout=timeout, upstream_ca=upstream_ca,
                      **kwargs)


def test_container_runs_as_no_account_on_a_read_only_root_with_the_project_at_work(tmp_path, engine):
    result = in_container(tmp_path, engine, "sh", "-c",
                          "id -u; echo no > /x; echo yes > /work/made && cat /work/made; pwd; exit 3")
    assert result.returncode == 3, result.stderr
    uid = int(result.stdout.split()[0])
    assert uid == container_user() and uid not in {entry.pw_uid for entry in pwd.getpwall()}  # N5: not 1000
    assert result.stdout.splitlines()[1:] == ["yes", "/work"]
    assert "Read-only file system" in result.stderr
    assert (tmp_path / "project" / "made").read_text() == "yes\n"


def test_the_containers_network_is_egress_namespace_with_lo_alone(tmp_path, engine):
    # (that the proxy is its only road out, tests/sandbox/test_conformance.py holds for every provider)
    result = in_container(tmp_path, engine, "ls", "/sys/class/net")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["lo"]


def test_a_fork_bomb_stops_at_the_pids_limit(tmp_path, engine):
    script = "n=0; while [ $n -lt 700 ]; do sleep 60 & n=$((n+1)); done; echo started"
    result = in_container(tmp_path, engine, "sh", "-c", script, extra=["--timeout", "60"])
    assert "can't fork" in result.stderr or "Resource temporarily unavailable" in result.stderr, result.stderr[-500:]
    assert engine.containers() == []


def test_the_memory_cap_holds(tmp_path, engine):
    policy = 'allow = ["allowed.test"]\n[container]\nmemory = "64m"\n'
    # one 200 MB line held by tail: more than the cap, and swap is capped equally: killed (128+9)
    result = in_container(tmp_path, engine, "sh", "-c",
                          "head -c 200000000 /dev/zero | tail -n 1 >/dev/null; echo $?", policy=policy)
    # the kernel's OOM killer takes tail (the shell says 137), or the whole container at once
    # (seen once with docker, two test workers on two cores: the run ended 137, nothing printed)
    killed = result.stdout.strip() == "137" or (result.returncode == 137 and result.stdout == "")
    assert killed, (result.returncode, result.stdout, result.stderr[-300:])


def test_mounts_are_read_only_unless_rw_and_persist_keeps_a_volume(tmp_path, engine):
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o777)
    volume = f"egress-test-{os.urandom(4).hex()}"
    try:
        first = in_container(tmp_path, engine, "sh", "-c", "echo a > /ro/x; echo b > /rw/x && echo kept > "
                             f"/persist/{volume}/file", extra=["--mount", f"{data}:/ro", "--mount", f"{data}:/rw:rw",
                                                               "--persist", volume])
        assert "Read-only file system" in first.stderr, first.stderr
        assert (data / "x").read_text() == "b\n"
        second = in_container(tmp_path, engine, "cat", f"/persist/{volume}/file", extra=["--persist", volume])
        assert second.stdout == "kept\n", second.stderr
    finally:
        engine.run("volume", "rm", "--force", volume)


# ------------------------------------------------------------------ egress's seccomp profile and user


# A static program (glibc, built here) that makes each call and prints "name errno" (0: it worked):
# the busybox image has no libc, and busybox has no keyctl or socket family of its choosing.
PROBE_SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void report(const char *name, long ret) { printf("%s %d\n", name, ret < 0 ? errno : 0); fflush(stdout); }
static long closed(long fd) { if (fd >= 0) close((int)fd); return fd; }
static long sock(long domain, int type, int proto) { return closed(syscall(SYS_socket, domain, type, proto)); }
static void *nothing(void *arg) { return arg; }

static long thread(void) {  /* glibc tries clone3 first, and falls back to clone on ENOSYS */
    pthread_t t;
    int e = pthread_create(&t, NULL, nothing, NULL);
    if (e) { errno = e; return -1; }
    return pthread_join(t, NULL) ? -1 : 0;
}

static long forked(void) {
    int status;
    pid_t pid = fork();
    if (pid == 0) _exit(7);
    if (pid < 0 || waitpid(pid, &status, 0) < 0) return -1;
    return WIFEXITED(status) && WEXITSTATUS(status) == 7 ? 0 : (errno = ECHILD, -1);
}

static long clone_flags(long flags) {  /* a child with these flags, which ends at once */
    long pid = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid((pid_t)pid, NULL, 0);
    return pid;
}

static long unshared(long flags) {  /* in a child: a namespace it made would stay with the probe */
    int status;
    pid_t pid = fork();
    if (pid == 0) _exit(syscall(SYS_unshare, flags) == 0 ? 0 : errno);
    waitpid(pid, &status, 0);
    return WEXITSTATUS(status) ? (errno = WEXITSTATUS(status), -1) : 0;
}

static long unix_pair(void) {
    int fds[2];
    char c = 0;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) < 0) return -1;
    long ok = write(fds[0], "u", 1) == 1 && read(fds[1], &c, 1) == 1 && c == 'u' ? 0 : -1;
    close(fds[0]);
    close(fds[1]);
    return ok;
}

static long inet_loopback(void) {  /* a TCP connection over lo */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof a;
    int s = socket(AF_INET, SOCK_STREAM, 0), c = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || c < 0) return -1;
    long ok = bind(s, (void *)&a, sizeof a) == 0 && listen(s, 1) == 0 && getsockname(s, (void *)&a, &n) == 0
              && connect(c, (void *)&a, sizeof a) == 0 ? closed(accept(s, NULL, NULL)) : -1;
    close(s);
    close(c);
    return ok < 0 ? -1 : 0;
}

int main(int argc, char **argv) {
    long ring = atol(argv[1]), key = atol(argv[2]);
    char buf[256] = {0};
    printf("uid %d\n", (int)getuid());
    /* keyrings (N2, N5): the user keyring of the container's uid, a ring and key of the host's uid 1000 */
    report("keyctl get @u", syscall(SYS_keyctl, 0, -4, 0));  /* KEYCTL_GET_KEYRING_ID */
    report("keyctl link", syscall(SYS_keyctl, 8, ring, -3));  /* KEYCTL_LINK into the session keyring */
    long got = syscall(SYS_keyctl, 11, key, buf, sizeof buf - 1);  /* KEYCTL_READ */
    report("keyctl read", got);
    if (got > 0) printf("payload %s\n", buf);
    report("add_key", syscall(SYS_add_key, "user", "egress-planted", "x", 1, -4));
    report("request_key", syscall(SYS_request_key, "user", "egress-none", 0, 0));
    /* socket families (N10): never bound or connected */
    report("vsock", sock(40, SOCK_STREAM, 0));
    report("vsock with high bits", sock(40L | 1L << 32, SOCK_STREAM, 0));
    report("packet", sock(17, SOCK_RAW, htons(3)));
    report("netlink audit", sock(16, SOCK_RAW, 9));
    report("netlink sock_diag", sock(16, SOCK_RAW, 4));
    report("socketpair inet", syscall(SYS_socketpair, AF_INET, SOCK_STREAM, 0, (int[2]){0}));
    report("unix", unix_pair());
    report("inet", inet_loopback());
    report("inet6", sock(AF_INET6, SOCK_DGRAM, 0));
    report("netlink route", sock(16, SOCK_RAW, 0));
    /* processes and namespaces (N6) */
    report("clone3", syscall(SYS_clone3, NULL, 0));  /* a size no kernel takes: EINVAL if let through */
    report("thread", thread());
    report("fork", forked());
    report("clone newuser", clone_flags(CLONE_NEWUSER));
    report("unshare newuser", unshared(CLONE_NEWUSER));
    report("unshare fs", unshared(CLONE_FS));
    report("setns", syscall(SYS_setns, -1, 0));  /* EBADF if let through */
    report("io_uring", syscall(SYS_io_uring_setup, 1, (char[120]){0}));
    report("syslog", syscall(SYS_syslog, 10, 0, 0));  /* SYSLOG_ACTION_SIZE_BUFFER */
    /* set-id files (N9), in the folder named */
    if (chdir(argv[3]) < 0) return 2;
    report("plain create", closed(syscall(SYS_openat, AT_FDCWD, "plain", O_CREAT | O_WRONLY, 0644)));
    report("setuid by chmod", syscall(SYS_fchmodat, AT_FDCWD, "plain", 04755));
    report("setgid by chmod", syscall(SYS_fchmodat, AT_FDCWD, "plain", 02755));
    int fd = open("plain", O_RDONLY);
    report("setuid by fchmod", syscall(SYS_fchmod, fd, 04755));
    close(fd);
    report("setgid by openat", closed(syscall(SYS_openat, AT_FDCWD, "su-openat", O_CREAT | O_WRONLY, 02755)));
    report("setuid by tmpfile", closed(syscall(SYS_openat, AT_FDCWD, ".", O_TMPFILE | O_WRONLY, 04755)));
    report("setuid by mknodat", syscall(SYS_mknodat, AT_FDCWD, "su-mknod", S_IFREG | 04755, 0));
#ifdef SYS_open
    report("setuid by open", closed(syscall(SYS_open, "su-open", O_CREAT | O_WRONLY, 04755)));
    report("setuid by creat", closed(syscall(SYS_creat, "su-creat", 04755)));
    report("setuid by chmod (old call)", syscall(SYS_chmod, "plain", 04755));
#endif
    report("openat2", closed(syscall(SYS_openat2, AT_FDCWD, "plain", (long long[3]){0}, 24)));
    /* what open's mode says when it creates nothing is whatever was in the register */
    report("open, garbage mode", closed(syscall(SYS_openat, AT_FDCWD, "plain", O_RDONLY, 06777)));
    report("open folder, garbage mode", closed(syscall(SYS_openat, AT_FDCWD, ".", O_RDONLY | O_DIRECTORY, 06777)));
    report("plain chmod", syscall(SYS_fchmodat, AT_FDCWD, "plain", 0755));
    return 0;
}
"""

# As the host's uid 1000 (the old container user): a key in its user keyring, held while the test
# runs, invalidated after. Prints the ring's and the key's serials.
KEY_HOLDER = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
add_key, keyctl = map(int, sys.argv[1:3])
ring = libc.syscall(keyctl, 0, -4, 1)  # KEYCTL_GET_KEYRING_ID of @u, made if need be
secret = b"UID-1000-KEYRING-SECRET"
key = libc.syscall(add_key, b"user", b"egress-test-uid-1000", secret, len(secret), -4)
print(ring, key, flush=True)
sys.stdin.read()
libc.syscall(keyctl, 21, key)  # KEYCTL_INVALIDATE
"""
KEY_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219), "riscv64": (217, 219)}  # add_key, keyctl


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """PROBE_SOURCE built static, in a folder every user can read (mounted read-only at /probe)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the probe (the test image has no libc)")
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.c").write_text(PROBE_SOURCE)
    built = subprocess.run(["gcc", "-static", "-O1", "-o", str(folder / "probe"), str(folder / "probe.c"),
                            "-lpthread"], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"gcc cannot build a static program here (libc6-dev): {built.stderr.strip()[-200:]}")
    folder.chmod(0o755)
    (folder / "probe").chmod(0o755)
    return folder


@pytest.fixture
def host_user_key():
    """(ring, key): the user keyring of the host's uid 1000 and a key in it, held for the test."""
    if os.uname().machine not in KEY_CALLS or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("the key holder needs /usr/bin/python3 and this machine's keyctl numbers")
    calls = map(str, KEY_CALLS[os.uname().machine])
    holder = subprocess.Popen(["/usr/bin/python3", "-I", "-S", "-c", KEY_HOLDER, *calls],
                              user=1000, group=1000, extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd="/")
    try:
        ring, key = map(int, holder.stdout.readline().split())
        assert ring > 0 and key > 0
        yield ring, key
    finally:
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()


def _host_has_ipv6() -> bool:
    import socket

    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
        return True
    except OSError:
        return False


def _set_id_files(*folders: Path) -> list[str]:
    import stat

    return [str(p) for folder in folders for p in folder.rglob("*")
            if p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID)]


def test_egress_profile_refuses_in_the_container_what_it_does_not_grant(tmp_path, engine, probe, host_user_key):
    """Each attempt worked in the red-team review (issue 25): the container, as the host's uid
    1000, read that user's keyring (N5: podman's default let keyctl through); AF_VSOCK shares the
    host's port space (N10); clone3 takes CLONE_INTO_CGROUP (N6); chmod 4755 in the project left
    a file giving every local account the owner's uid (N9). What programs need keeps working."""
    ring, key = host_user_key
    result = in_container(tmp_path, engine, "/probe/probe", str(ring), str(key), "/work",
                          extra=["--mount", f"{probe}:/probe"])
    assert result.returncode == 0, result.stderr
    seen = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    assert int(seen.pop("uid")) == container_user() != 1000
    assert "payload" not in seen, seen["payload"]  # uid 1000's key stays unread
    refused = {
        errno.EPERM: ["keyctl get @u", "keyctl link", "keyctl read", "add_key", "request_key", "clone newuser",
                      "unshare newuser", "setns", "syslog", "setuid by chmod", "setgid by chmod", "setuid by fchmod",
                      "setgid by openat", "setuid by tmpfile", "setuid by mknodat"]
                     + (["setuid by open", "setuid by creat", "setuid by chmod (old call)"]
                        if "setuid by open" in seen else []),
        errno.EAFNOSUPPORT: ["vsock", "vsock with high bits", "packet", "netlink audit", "netlink sock_diag",
                             "socketpair inet"],
        errno.ENOSYS: ["clone3", "io_uring", "openat2"],
        0: ["unix", "inet", "netlink route", "thread", "fork", "unshare fs", "plain create", "open, garbage mode",
            "open folder, garbage mode", "plain chmod"] + (["inet6"] if _host_has_ipv6() else []),
    }
    assert {name: int(seen[name]) for names in refused.values() for name in names} == {
        name: err for err, names in refused.items() for name in names}
    project = tmp_path / "project"
    assert _set_id_files(project) == [] and (project / "plain").stat().st_mode & 0o7777 == 0o755
    assert (project / "plain").stat().st_uid == OWNER  # made by the container's user, the owner's on the host


def test_no_set_id_file_is_left_and_every_writable_mount_is_nosuid(tmp_path, engine):
    """N9: a container run as root over another user's project left `chmod 4755` files that gave
    any local account the owner's uid. egress's profile refuses the modes; and the project's view
    and every writable mount are nosuid, so a set-id file there would give nothing."""
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    script = ("touch /work/f /data/f; chmod 4755 /work/f; echo work=$?; chmod 2755 /work/f; echo sgid=$?;"
              " chmod 4755 /data/f; echo data=$?; chmod 755 /work/f; echo plain=$?;"
              " grep -E ' /(work|data) ' /proc/self/mountinfo")
    result = in_container(tmp_path, engine, "sh", "-c", script, extra=["--mount", f"{data}:/data:rw"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:4] == ["work=1", "sgid=1", "data=1", "plain=0"], result.stdout
    options = {line.split()[4]: line.split()[5].split(",") for line in lines[4:]}
    assert set(options) == {"/work", "/data"} and all("nosuid" in o for o in options.values()), options
    assert _set_id_files(tmp_path / "project", data) == []
    assert (data / "f").stat().st_uid == container_user()  # the engine's ids there: no account's
    assert left_views() == []  # the writable mount's view detached, its folder gone


@pytest.mark.parametrize("name", ["podman", "docker"])
def test_without_the_engines_default_profile_nothing_runs(tmp_path, name):
    """The profile is built on the engine's default allow list; where it is missing, egress says
    so in one line and runs nothing, rather than run with a weaker profile."""
    from sandbox import container_seccomp

    if shutil.which(name) is None or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip(f"{name}, unshare and root are needed (the other refusals come first otherwise)")
    project = make_project(tmp_path)
    (tmp_path / "policy.toml").write_text(POLICY)
    folders = sorted({os.path.dirname(p) for p in container_seccomp.DEFAULT_PROFILES})
    masks = "".join(f"mount -t tmpfs tmpfs {folder} && " for folder in folders if os.path.isdir(folder))
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", masks + 'exec "$@"', "sh",
                             *egress_command(), "run", "--policy", str(tmp_path / "policy.toml"), "--state-dir",
                             str(tmp_path / "state"), "--provider", name, "--image", IMAGE, "--", "touch", "/work/ran"],
                            cwd=project, capture_output=True, text=True, timeout=120,
                            env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))
    assert result.returncode == 125, result.stderr
    said = [line for line in result.stderr.splitlines() if "seccomp" in line]
    assert len(said) == 1 and (f"egress builds the containers' seccomp profile on the engine's default allow list, "
                               f"{container_seccomp.DEFAULT_PROFILES[-1]}, which is missing: install "
                               f"{container_seccomp.PACKAGE}; nothing ran") in said[0], result.stderr
    assert not (project / "ran").exists()


def test_the_state_folder_in_the_project_cannot_be_moved_away(tmp_path, engine):
    """The state folder in the project (a project at $HOME): its cover must not move with a renamed
    parent. Measured before the folders on the way were pinned: docker ran `mv /work/.local
    /work/.local2`, the rename stuck on the host, and the command made the state folder again with
    its own CA for the next run. Podman refuses this layout before the command starts (126)."""
    home = Path(tempfile.mkdtemp(prefix="egress-home-", dir="/tmp"))  # short: the control socket's path has 108 bytes
    try:
        _state_folder_cannot_be_moved_away(tmp_path, engine, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _state_folder_cannot_be_moved_away(tmp_path, engine, project):
    os.chown(project, OWNER, OWNER_GROUP)
    state = project / ".local" / "state" / "egress"

    def run(*command):  # (the last --state-dir is the one egress takes)
        return egress_run(tmp_path, *command, extra=["--provider", engine.name, "--image", engine.image,
                                                     "--state-dir", str(state)], project=project, env=engine.env)

    first = run("true")  # the state folder and its CA, as a run leaves them
    # podman: its runc copies what a tmpfs covers into it (tmpcopyup), and cannot read egress's state
    # through the owner-mapped view: 126, nothing ran
    assert first.returncode == (126 if engine.name == "podman" else 0), first.stderr
    for folder in (project / ".local", project / ".local" / "state"):
        os.chown(folder, OWNER, OWNER_GROUP)  # the project owner's, as in a home folder
    chain = [project / ".local", project / ".local" / "state", state, state / "ca"]
    before = {path: os.lstat(path).st_ino for path in chain}
    ca = (state / "ca" / "mitmproxy-ca.pem").read_bytes()
    entries = sorted(p.name for p in project.iterdir())
    # each within its own folder: busybox's mv copies across mounts (EXDEV), and that is no move
    attempts = {"mv grandparent": "mv /work/.local /work/.local2", "mv parent": "mv /work/.local/state /work/.local/s2",
                "mv state": "mv /work/.local/state/egress /work/.local/state/e2", "rmdir state": "rmdir /work/.local/state/egress"}
    script = "".join(f"{command} 2>/dev/null; echo {name.replace(' ', '_')}=$?; " for name, command in attempts.items())
    # what the command would plant for the next run, were any move let through
    script += ("mkdir -p /work/.local/state/egress/ca && echo planted > /work/.local/state/egress/ca/mitmproxy-ca.pem; "
               "stat -c %u /work/.local; touch /work/.local/mine && echo wrote")
    result = run("sh", "-c", script)
    if engine.name == "podman":
        assert result.returncode == 126 and "wrote" not in result.stdout, result.stderr  # nothing ran
    else:
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[:len(attempts)] == [f"{name.replace(' ', '_')}=1" for name in attempts], result.stdout
        # the pins come from the owner-mapped view: the owner's folder is still the container user's
        assert lines[len(attempts):] == [str(container_user()), "wrote"], result.stdout
        (project / ".local" / "mine").unlink()
    # Nothing moved or planted on the host.
    assert {path: os.lstat(path).st_ino for path in chain} == before
    assert (state / "ca" / "mitmproxy-ca.pem").read_bytes() == ca
    assert sorted(p.name for p in project.iterdir()) == entries
    assert left_views() == []


# ------------------------------------------------------------------ secrets and the project's owner


FILE_SECRET = "egress-test-secret-9c2f4b7e1a0d5e3186f2"


def test_brokered_secrets_reach_only_their_host_and_never_the_container(tmp_path, engine, https_upstream,
                                                                        test_ca_file):
    from test_credentials import GITHUB

    project = tmp_path / "project"
    project.mkdir()
    keys = tmp_path / "keys"  # outside the project (inside, the run is refused), shown read-only
    keys.mkdir()
    (keys / ".token").write_text(FILE_SECRET + "\n")  # the container sees it at /keys: the real one must stay covered
    policy = ('allow = ["allowed.test", "other.test"]\nallow_private = ["allowed.test", "other.test"]\n'
              '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
              f'[[credentials.secret]]\nfile = "{keys / ".token"}"\nhosts = ["allowed.test"]\n'
              'header = "X-File"\n')  # swapped in that header only (the default is Authorization)
    headers = '-H "Authorization: token $GITHUB_TOKEN" -H "X-File: $(cat /keys/.token)"'
    script = (f'echo "$GITHUB_TOKEN"; cat /keys/.token; '
              f'curl -sS {headers} {https_upstream.url("allowed.test")}; '
              f'curl -sS -o /dev/null -w "%{{http_code}}\\n" {headers} {https_upstream.url("other.test")}; '
              'tr "\\0" "\\n" < /proc/$$/environ; '  # the command's own (docker's PID 1 is the holder)
              'touch /work/ready || exit 9; while [ ! -e /work/go ]; do sleep 0.1; done')
    inspected, ended = [], threading.Event()

    def inspect():  # while the container runs: what the engine keeps of it
        try:
            while not (project / "ready").exists():
                if ended.wait(0.1):
                    return
            ids = engine.run("ps", "-q", "--filter", f"ancestor={engine.image}").stdout.split()
            inspected.append(engine.run("inspect", *ids).stdout)
        finally:
            (project / "go").touch()

    watcher = threading.Thread(target=inspect)
    watcher.start()
    try:
        result = in_container(tmp_path, engine, "sh", "-c", script, policy=policy, upstream_ca=test_ca_file,
                              env={"GITHUB_TOKEN": GITHUB}, extra=["--mount", f"{keys}:/keys"])
    finally:
        ended.set()
        watcher.join()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    token, shown = lines[0], lines[1]
    assert token.startswith("ghp_") and len(token) == len(GITHUB) and token != GITHUB
    assert len(shown) == len(FILE_SECRET) and shown != FILE_SECRET
    assert lines[2:4] == ["hello from upstream", "403"]
    assert f"GITHUB_TOKEN={token}" in lines[4:]  # the container's own environment: the placeholder
    # The bound host got both real values, swapped in by egress; the other host got nothing.
    assert [(r["headers"]["Authorization"], r["headers"]["X-File"]) for r in https_upstream.requests] == [
        (f"token {GITHUB}", FILE_SECRET)]
    assert "EGRESS_BLOCKED other.test (the request carries a credential)" in result.stderr
    assert inspected and '"Id"' in inspected[0] and token in inspected[0]
    for text in (result.stdout, result.stderr, inspected[0]):
        assert GITHUB not in text and FILE_SECRET not in text
    assert (keys / ".token").read_text() == FILE_SECRET + "\n"


def test_a_writable_mount_counts_as_the_project_for_secrets_and_policies(tmp_path, engine, http_upstream):
    """What `--mount SRC:DST:rw` holds the container can change, as it can /work: a secret file
    there stops the run (it could leave a decoy for the next), and a policy file there keeps the
    text it started with (the command's edit is not reloaded)."""
    from egress.host.live import POLL_SECONDS

    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o777)
    (data / "token").write_text(FILE_SECRET + "\n")
    policy = POLICY + f'[[credentials.secret]]\nfile = "{data / "token"}"\nhosts = ["allowed.test"]\n'
    refused = in_container(tmp_path, engine, "touch", "/work/ran", policy=policy, extra=["--mount", f"{data}:/data:rw"])
    assert refused.returncode == 125, refused.stderr
    assert f"the secret 'token' is read from {data / 'token'}, which the command could change" in refused.stderr
    assert not (tmp_path / "project" / "ran").exists()

    (data / "egress.toml").write_text('allow_private = ["other.test"]\n')
    os.chmod(data / "egress.toml", 0o666)
    status = 'curl -s -o /dev/null -w "%{http_code}\\n"'
    script = (f"{status} {http_upstream.url('blocked.test')}; "
              "printf 'allow = [\"other.test\"]\\nallow_private = [\"other.test\"]\\n' > /data/egress.toml; "
              f"sleep {2 * POLL_SECONDS + 0.5}; {status} {http_upstream.url('other.test')}")
    result = in_container(tmp_path, engine, "sh", "-c", script,
                          extra=["--mount", f"{data}:/data:rw", "--policy", str(data / "egress.toml")])
    assert result.stdout.split() == ["403", "403"], result.stderr
    assert 'allow = ["other.test"]' in (data / "egress.toml").read_text()  # the container could write it
    assert "changed, but the command can write it" in result.stderr
    assert http_upstream.connections == 0


def test_files_made_in_work_belong_to_the_projects_owner_and_nothing_else_is_writable(tmp_path, engine):
    project = tmp_path / "project"
    project.mkdir()
    (project / "link").symlink_to("/etc/passwd")  # a way out of /work, were the host's /etc shown
    script = ("id -u; stat -c %u:%g /work; echo a > /work/made && mkdir /work/sub && echo b > /work/sub/f; "
              "for p in /x /etc/x /work/../y /work/link /bin/x; do echo no > $p && echo wrote $p; done; true")
    result = in_container(tmp_path, engine, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    uid = container_user()
    assert result.stdout.splitlines() == [str(uid), f"{uid}:{uid}"]  # the owner's project, as its user sees it
    for made in ("made", "sub", "sub/f"):
        info = (project / made).lstat()
        assert (info.st_uid, info.st_gid) == (OWNER, OWNER_GROUP), made
    assert result.stderr.count("Read-only file system") == 5, result.stderr
    assert not os.path.exists(tmp_path / "y")
    assert left_views() == []  # the view is detached and its folder gone once the run ends


def test_a_project_owned_by_root_is_refused_before_anything_runs(tmp_path, podman):
    env, image = podman.env, podman.image
    project = tmp_path / "project"
    project.mkdir()
    result = egress_run(tmp_path, "touch", "/work/ran", extra=["--provider", "podman", "--image", image],
                        project=project, env=env)
    assert result.returncode == 125 and "is owned by root" in result.stderr, result.stderr
    assert not (project / "ran").exists()


def test_a_project_in_a_group_its_owner_is_not_in_is_refused(tmp_path, podman):
    """A project chowned to its owner but left in group root: mapped, the container could make
    setgid files of root's group on the host. Refused before anything runs."""
    project = tmp_path / "project"
    project.mkdir()
    os.chown(project, OWNER, 0)
    result = egress_run(tmp_path, "touch", "/work/ran", extra=["--provider", "podman", "--image", podman.image],
                        project=project, env=podman.env)
    assert result.returncode == 125, result.stderr
    assert "its group, gid 0, is not one of its owner nobody's own groups" in result.stderr
    assert not (project / "ran").exists()


def test_a_project_whose_owner_egress_cannot_look_up_is_refused(tmp_path, podman):
    unknown = next(uid for uid in range(4242, 5242) if uid not in {e.pw_uid for e in pwd.getpwall()})
    project = tmp_path / "project"
    project.mkdir()
    os.chown(project, unknown, unknown)
    result = egress_run(tmp_path, "touch", "/work/ran", extra=["--provider", "podman", "--image", podman.image],
                        project=project, env=podman.env)
    assert result.returncode == 125 and f"uid {unknown}, has no entry in the user database" in result.stderr
    assert not (project / "ran").exists()


def test_the_owner_mapping_opens_the_project_once_and_follows_no_symlink_there(tmp_path):
    from sandbox import idmap

    if os.geteuid() != 0:
        pytest.skip("idmapped mounts are root's")
    rootdir = tmp_path / "rootdir"
    rootdir.mkdir()
    (tmp_path / "link").symlink_to(rootdir)
    (tmp_path / "target").mkdir()
    with pytest.raises(OSError) as refused:
        idmap.owner_mapped(str(tmp_path / "link"), str(tmp_path / "target"), 1000, 1000)
    assert "cannot open the project" in str(refused.value)
    with pytest.raises(idmap.Refused):
        idmap.owner_mapped(str(rootdir), str(tmp_path / "target"), 1000, 1000)  # root's, through the same descriptor


def test_a_project_the_owner_mapping_cannot_be_made_for_runs_nothing(tmp_path, podman):
    # ramfs has no idmapped mounts: the run must stop, not hand the container a project it cannot write
    # (or, made writable for it, one everybody can write).
    env, image = podman.env, podman.image
    project = tmp_path / "project"
    project.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0755", "ramfs", str(project)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.strip()}")
    try:
        os.chown(project, OWNER, OWNER_GROUP)
        result = egress_run(tmp_path, "touch", "/work/ran", extra=["--provider", "podman", "--image", image],
                            project=project, env=env)
        assert result.returncode == 125, result.stderr
        assert f"cannot show the project {project} to the container's user" in result.stderr
        assert os.listdir(project) == []
    finally:
        subprocess.run(["umount", str(project)], check=True)
    assert left_views() == []


def test_a_view_left_by_a_killed_run_is_taken_away_by_the_next_run(tmp_path, podman):
    import signal

    env, image = podman.env, podman.image
    project = make_project(tmp_path)
    (tmp_path / "policy.toml").write_text('allow = ["allowed.test"]\n')
    (tmp_path / "launcher-tmp").mkdir()  # the killed run's own temporary folder stays there, not in /tmp
    run = subprocess.Popen([*egress_command(), "run", "--policy", str(tmp_path / "policy.toml"), "--state-dir",
                            str(tmp_path / "state"), "--provider", "podman", "--image", image, "--", "sh", "-c",
                            "touch /work/ready; sleep 600"], cwd=project, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path / "launcher-tmp"), **env))
    try:
        while not (project / "ready").exists() and run.poll() is None:
            time.sleep(0.1)
        os.kill(run.pid, signal.SIGKILL)  # no close(): its view of the project stays attached
        run.wait()
        left = [n for n in os.listdir(ct.RUNTIME_DIR) if n.startswith(f"{ct._PREFIX}{run.pid}-")]
        assert len(left) == 1 and f"/{left[0]}/work " in open("/proc/self/mountinfo").read()
    finally:
        if run.poll() is None:
            run.kill()
    assert in_container(tmp_path, podman, "true").returncode == 0
    assert not os.path.exists(os.path.join(ct.RUNTIME_DIR, left[0]))
    assert f"/{left[0]}/work " not in open("/proc/self/mountinfo").read()


def test_the_sweep_of_killed_runs_views_follows_no_planted_symlink(tmp_path):
    """A name in RUNTIME_DIR that looks like a dead run's view but is a symlink (or holds one at
    `work`) is left alone: root's sweep must never detach or unlink through it."""
    if os.geteuid() != 0:
        pytest.skip("the views and their sweep are root's (/run)")
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))
    target, mounted = tmp_path / "target", tmp_path / "mounted"
    target.mkdir()
    (target / "shown0").write_text("keep")
    (target / "work").mkdir()
    mounted.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    planted = [os.path.join(ct.RUNTIME_DIR, f"{ct._PREFIX}{dead}-link"), os.path.join(ct.RUNTIME_DIR, f"{ct._PREFIX}{dead}-dir")]
    try:
        os.symlink(target, planted[0])  # the whole folder a symlink
        os.mkdir(planted[1])
        os.symlink(mounted, os.path.join(planted[1], "work"))  # its view a symlink to a mount
        ct._sweep()
        assert (target / "shown0").read_text() == "keep" and os.path.islink(planted[0])
        assert f" {mounted} " in open("/proc/self/mountinfo").read()  # still mounted
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)
        for path in planted:
            if os.path.islink(path):
                os.unlink(path)
            elif os.path.isdir(path):
                for name in os.listdir(path):
                    os.unlink(os.path.join(path, name))
                os.rmdir(path)


def left_views() -> list[str]:
    """Owner-mapped views of runs that ended (a run still going, another test's, has its own)."""
    return [name for name in os.listdir(ct.RUNTIME_DIR) if name.startswith(ct._PREFIX)
            and not os.path.exists(f"/proc/{name[len(ct._PREFIX):].split('-')[0]}")]


# ------------------------------------------------------------------ rootless podman: refused, and said why


def test_rootless_is_refused_only_for_podman_and_only_for_an_unprivileged_caller():
    assert ct.rootless_refusal("podman", 0) is None and ct.rootless_refusal("docker", 1000) is None
    refusal = ct.rootless_refusal("podman", 1000)
    assert ct.ROOTLESS_REASON in refusal and refusal.endswith(ct.ROOTLESS_FIX) and "nothing ran" in refusal


def test_rootless_podman_is_refused_before_anything_runs_and_the_doctor_says_why(user_venv):
    venv, nobody = user_venv
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    with nobody_home(nobody) as (home, project):
        as_nobody = {"capture_output": True, "text": True, "timeout": 120, "cwd": project, "user": nobody.pw_uid,
                     "group": nobody.pw_gid, "extra_groups": [], "env": {"PATH": "/usr/bin:/bin", "HOME": home}}
        result = subprocess.run([f"{venv}/bin/egress", "run", "--provider", "podman", "--image", IMAGE, "--",
                                 "touch", "ran"], **as_nobody)
        assert result.returncode == 125, result.stderr
        assert ct.ROOTLESS_REASON in result.stderr and ct.ROOTLESS_FIX in result.stderr
        assert not os.path.exists(os.path.join(project, "ran"))
        doctor = subprocess.run([f"{venv}/bin/egress", "doctor", "--json"], **as_nobody)
        rows = {row["name"]: row for row in map(json.loads, doctor.stdout.splitlines())}
        assert rows["provider podman"]["status"] == "unavailable"
        assert ct.ROOTLESS_REASON in rows["provider podman"]["detail"]
        assert rows["provider podman"]["fix"] == ct.ROOTLESS_FIX


@pytest.fixture
def rootless(podman, image_tarball, tmp_path):
    """A function running a command as a user made for the test, with /etc/subuid entries (useradd
    adds them), this machine's engine settings and the test image in its rootless podman."""
    import pwd

    if not all(shutil.which(tool) for tool in ("useradd", "userdel", "newuidmap", "unshare")):
        pytest.skip("useradd, userdel, newuidmap (uidmap) and unshare are needed for a rootless podman")
    name = f"egress-rl{os.urandom(3).hex()}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    user = pwd.getpwnam(name)
    try:
        if not any(line.startswith(f"{name}:") for line in open("/etc/subuid")):
            pytest.skip("useradd gave the user no /etc/subuid range here")
        home = user.pw_dir
        runtime = os.path.join(home, "run")
        os.mkdir(runtime, 0o700)
        os.chown(runtime, user.pw_uid, user.pw_gid)
        conf = os.path.join(home, "containers.conf")
        shutil.copy(podman.env["CONTAINERS_CONF"], conf)
        os.chmod(conf, 0o644)
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home, "XDG_RUNTIME_DIR": runtime,
               "CONTAINERS_CONF": conf}

        def as_user(*argv, wait=True, **kwargs):
            start = subprocess.run if wait else subprocess.Popen
            return start(list(argv), user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=env, cwd=home,
                         **({"capture_output": True, "text": True, "timeout": 120} if wait else {}), **kwargs)

        tarball = os.path.join(home, "image.tar")
        shutil.copy(image_tarball, tarball)
        os.chown(tarball, user.pw_uid, user.pw_gid)
        made = as_user("podman", "import", tarball, IMAGE)
        if made.returncode != 0:
            pytest.skip(f"rootless podman cannot import an image here: {made.stderr.strip()[-300:]}")
        yield as_user
    finally:
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):  # what the test's user started
            try:
                if os.stat(f"/proc/{pid}").st_uid == user.pw_uid:
                    os.kill(pid, 9)
            except OSError:
                pass
        time.sleep(0.5)
        subprocess.run(["userdel", "--remove", name], capture_output=True)


def test_rootless_podman_cannot_join_a_namespace_its_user_made_only_one_made_in_its_own(rootless, tmp_path):
    """What egress's refusal rests on, measured: egress's namespace (a user namespace of the caller's
    own with a network namespace in it, as `unshare -Urn` makes) is out of rootless podman's
    reach; one made inside podman's user namespace (`podman unshare`) is joined."""
    holder = rootless("unshare", "-Urn", "sleep", "600", wait=False)
    try:
        time.sleep(0.5)
        joined = rootless("podman", "run", "--rm", "--network", f"ns:/proc/{holder.pid}/ns/net", IMAGE, "true")
    finally:
        holder.kill()
        holder.wait()
    assert joined.returncode != 0
    assert f"stat /proc/{holder.pid}/ns/net: permission denied" in joined.stderr, joined.stderr
    pid_file = os.path.join(rootless("sh", "-c", "echo $HOME").stdout.strip(), "holder.pid")
    inside = rootless("podman", "unshare", "unshare", "-n", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 600",
                      wait=False)
    try:
        while not os.path.exists(pid_file) or not open(pid_file).read().strip():
            time.sleep(0.1)
        pid = open(pid_file).read().strip()
        joined = rootless("podman", "run", "--rm", "--network", f"ns:/proc/{pid}/ns/net", IMAGE, "ls",
                          "/sys/class/net")
        assert joined.returncode == 0 and joined.stdout.split() == ["lo"], joined.stderr
        if os.path.exists("/sys/fs/cgroup/memory"):  # cgroups v1, as here: the hardening's limits would not hold
            limited = rootless("podman", "run", "--rm", "--network", "none", "--memory", "64m", "--pids-limit", "64",
                               IMAGE, "true")
            assert limited.returncode == 0 and "Resource limits are not supported and ignored" in limited.stderr
    finally:
        inside.kill()
        inside.wait()


# ------------------------------------------------------------------ docker: the holder


def test_a_killed_egress_leaves_no_container_behind(tmp_path, engine):
    """SIGKILL gives egress no chance to clean up: the holder's stdin closes, it exits, and the
    kernel ends its PID namespace, the command's container with it; --rm removes them. (podman's
    container joins the PID namespace of egress's own holder; before it did, this one lived on.)"""
    project = make_project(tmp_path)
    (tmp_path / "policy.toml").write_text(POLICY)
    (tmp_path / "launcher-tmp").mkdir()
    run = subprocess.Popen([*egress_command(), "run", "--policy", str(tmp_path / "policy.toml"), "--state-dir",
                            str(tmp_path / "state"), "--provider", engine.name, "--image", engine.image, "--",
                            "sh", "-c", "echo started; sleep 300"], cwd=project, stdout=subprocess.PIPE, text=True,
                           env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path / "launcher-tmp"),
                                         **engine.env))
    try:
        assert run.stdout.readline() == "started\n"
        # docker: the command's and its holder; podman: the command's (its holder is a process)
        assert len(engine.containers()) == (2 if engine.name == "docker" else 1)
    finally:
        run.kill()
        run.wait()
        run.stdout.close()
    for _ in range(600):
        if engine.containers() == []:
            break
        time.sleep(0.1)
    assert engine.containers() == []


def test_podman_pid_1_is_egress_holder_and_no_way_out(tmp_path, podman):
    """The container shares the PID namespace of the holder egress made: PID 1 (its init) and
    PID 2 (the holder) are root's, so the container's user can neither signal them nor read
    their root folder or environment."""
    script = ("kill -9 1; echo kill1=$?; kill -9 2; echo kill2=$?; ls /proc/1/root/ >/dev/null; echo root1=$?;"
              " ls /proc/2/root/ >/dev/null; echo root2=$?; cat /proc/1/environ >/dev/null; echo environ1=$?;"
              " cat /proc/2/environ >/dev/null; echo environ2=$?; stat -c %u /proc/1 /proc/2")
    result = in_container(tmp_path, podman, "sh", "-c", script)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stderr
    for probe in ("kill1", "kill2", "root1", "root2", "environ1", "environ2"):
        assert f"{probe}=1" in lines, result.stdout
    assert lines[-2:] == ["0", "0"], result.stdout
    assert podman.containers() == []


def test_the_holder_is_no_way_out(tmp_path, docker, test_host):
    """From inside: PID 1 is the holder, another user's (65534): it cannot be signalled, traced or
    entered; DNS to any server, direct TCP and ICMP are captured or refused; and the holder itself
    runs with the whole hardening list and no network of its own."""
    script = ("kill -9 1; echo kill=$?; ls /proc/1/root/ >/dev/null; echo root=$?; cat /proc/1/environ >/dev/null;"
              " echo environ=$?; nslookup example.com 198.51.100.2 >/dev/null 2>&1; echo dns=$?;"
              " echo x | nc -w 3 198.51.100.2 53; echo nc=$?; ls /var/run/docker.sock; echo sock=$?;"
              " curl -sS --noproxy '*' --max-time 10 -g 'http://[64:ff9b::c633:6402]:8080/'; echo ip6=$?;"
              " ip addr add 10.9.9.9/32 dev lo; echo addr=$?; ip link set lo down; echo down=$?;"
              " cat /proc/1/comm")
    result = in_container(tmp_path, docker, "sh", "-c", script)
    lines = result.stdout.splitlines()
    for probe in ("kill", "root", "environ", "sock", "ip6", "addr", "down"):
        assert f"{probe}=0" not in lines, result.stdout
    assert lines[-1] == "hold", result.stdout
    time.sleep(0.5)
    assert not os.path.exists(test_host), open(test_host).read()  # no TCP, no UDP (DNS) reached it
    assert docker.containers() == []


def test_the_holder_gets_the_hardening_list(tmp_path, docker):
    """The holder's own configuration, read from the engine while a run holds it."""
    from sandbox import container_seccomp, idmap

    user, holder_user = idmap.container_ids()
    project = make_project(tmp_path)
    (tmp_path / "policy.toml").write_text(POLICY)
    (tmp_path / "launcher-tmp").mkdir()
    run = subprocess.Popen([*egress_command(), "run", "--policy", str(tmp_path / "policy.toml"), "--state-dir",
                            str(tmp_path / "state"), "--provider", "docker", "--image", docker.image, "--",
                            "sh", "-c", "echo started; read x; exit 0"], cwd=project, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True,
                           env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path / "launcher-tmp"),
                                         **docker.env))
    try:
        assert run.stdout.readline() == "started\n"
        holder = [name for name in docker.containers() if name.endswith("-holder")]
        assert len(holder) == 1
        config = json.loads(docker.run("inspect", holder[0]).stdout)[0]
        host = config["HostConfig"]
        assert host["NetworkMode"] == "none" and host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"]
        assert "no-new-privileges" in host["SecurityOpt"] and host["PidsLimit"] == 512
        assert config["Config"]["User"] == f"{holder_user}:{holder_user}" and host["Binds"] in (None, [])
        command = [name for name in docker.containers() if name not in holder][0]
        inspected = json.loads(docker.run("inspect", command).stdout)[0]
        joined = inspected["HostConfig"]
        assert joined["NetworkMode"].startswith("container:")
        assert joined["PidMode"].startswith("container:")
        assert inspected["Config"]["User"] == f"{user}:{user}" != config["Config"]["User"]
        # both with egress's seccomp profile (docker keeps its text), written for the run, root's alone
        profile = [o for o in host["SecurityOpt"] if o.startswith("seccomp=")]
        assert profile and json.loads(profile[0][len("seccomp="):]) == json.loads(container_seccomp.profile_text())
        assert [o for o in joined["SecurityOpt"] if o.startswith("seccomp=")] == profile
        written = [os.path.join(ct.RUNTIME_DIR, n, container_seccomp.FILE_NAME) for n in os.listdir(ct.RUNTIME_DIR)
                   if n.startswith(f"{ct._PREFIX}{run.pid}-")]
        assert len(written) == 1 and os.stat(written[0]).st_mode & 0o777 == 0o600
    finally:
        run.stdin.close()
        assert run.wait(120) == 0
        run.stdout.close()
    assert docker.containers() == []


def test_a_namespace_with_an_interface_up_is_refused_and_a_bare_one_is_set_up():
    """linux.enter_network on namespaces the test made: one with only lo gets the proxy socket
    and the capture; one with another interface up is refused (it would be a road out)."""
    from sandbox import linux
    from sandbox.spec import SandboxError, SandboxSpec

    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("making network namespaces needs root and iproute2 (ip)")
    spec = SandboxSpec(["true"], {}, "/", network=True, proxy_port=3128, capture=True)
    bare, busy = f"egress-bare-{os.urandom(3).hex()}", f"egress-busy-{os.urandom(3).hex()}"
    try:
        subprocess.run(["ip", "netns", "add", bare], check=True)
        subprocess.run(["ip", "netns", "add", busy], check=True)
        subprocess.run(["ip", "-n", busy, "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=True)
        subprocess.run(["ip", "-n", busy, "link", "set", "d0", "up"], check=True)
        fd = os.open(f"/run/netns/{bare}", os.O_RDONLY)
        try:
            network = linux.enter_network(fd, spec)
        finally:
            os.close(fd)
        try:
            assert network.listen_socket.getsockname() == ("127.0.0.1", 3128)
            assert network.capture_error is None and {tag for tag, _ in network.capture} >= {"T", "D", "N"}
        finally:
            network.close()
        fd = os.open(f"/run/netns/{busy}", os.O_RDONLY)
        try:
            with pytest.raises(SandboxError, match=r"interfaces up besides lo \(d0\)") as refused:
                linux.enter_network(fd, spec)
            assert refused.value.code == 125
        finally:
            os.close(fd)
    finally:
        subprocess.run(["ip", "netns", "delete", bare], capture_output=True)
        subprocess.run(["ip", "netns", "delete", busy], capture_output=True)


def test_docker_is_refused_to_an_unprivileged_egress(monkeypatch):
    """egress enters the namespace Docker made as root: without root it cannot, and says so first."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    refusal = ct.Container("docker", ct.ContainerSpec("img")).refusal()
    if shutil.which("docker") is None:
        assert "not installed" in refusal
    else:
        assert "egress must run as root" in refusal


def test_doctor_says_what_docker_is_here(tmp_path, docker):
    result = subprocess.run([*egress_command(), "doctor", "--json"], capture_output=True, text=True, timeout=120,
                            env=clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state"), **docker.env))
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    row = rows["provider docker"]
    version = docker.run("version", "--format", "{{.Server.Version}}").stdout.strip()
    assert row["status"] == "warning" and row["fix"], row
    assert f"version {version}, a root daemon" in row["detail"] and "not tried by egress doctor" in row["detail"]


def test_an_image_posing_as_the_holder_is_replaced(tmp_path, docker):
    """The holder's name is known: whatever holds it must be egress's program, byte for byte."""
    from sandbox import holder

    assert docker.run("tag", docker.image, holder.image_tag()).returncode == 0
    result = in_container(tmp_path, docker, "cat", "/proc/1/comm")
    assert result.stdout == "hold\n", result.stderr
    layers = docker.run("image", "inspect", "--format", "{{json .RootFS.Layers}}", holder.image_tag()).stdout
    assert json.loads(layers) == ["sha256:" + hashlib.sha256(holder.image_tarball()).hexdigest()]


def test_files_that_run_later_are_read_only_in_the_container(tmp_path, engine):
    # Issue 25 item 7, as for the namespace provider: a git hook or config written from the
    # container would run on the user's next git command, unconfined.
    project = make_project(tmp_path)
    hooks = project / ".git" / "hooks"
    hooks.mkdir(parents=True)
    (project / ".git" / "config").write_text("[core]\n\tbare = false\n")
    for path in (project / ".git", hooks, project / ".git" / "config"):
        os.chown(path, OWNER, OWNER_GROUP)
    script = ("echo x > /work/.git/hooks/pre-commit 2>/dev/null; echo hook=$?; "
              "echo x >> /work/.git/config 2>/dev/null; echo config=$?; "
              "mv /work/.git /work/.git2 2>/dev/null; echo move=$?; "
              "echo 'echo planted' > /work/.envrc; echo envrc=$?; touch /work/ordinary; echo ordinary=$?")
    result = in_container(tmp_path, engine, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    seen = dict(line.split("=") for line in result.stdout.split())
    assert seen["ordinary"] == "0" and seen["envrc"] == "0", seen  # the project stays writable
    assert "0" not in (seen["hook"], seen["config"], seen["move"]), seen
    assert not (hooks / "pre-commit").exists() and (project / ".git" / "config").read_text().endswith("false\n")
    assert not (project / ".envrc").exists() and "the command made" in result.stderr  # moved aside after the run
