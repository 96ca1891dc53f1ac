"""`egress run --provider`: local (no sandbox, said first), podman and docker (a hardened container
in a network namespace egress set up), and egress doctor's words for each.

The container tests run each behaviour on both engines for real: a rootful podman, and a dockerd
of the test's own (its own socket and folders, stopped by its pid), with an image imported from
a tarball made here (a static busybox, and curl with its libraries copied from this machine: no
registry). This machine's engine settings (runc, cgroupfs, no default ulimits, vfs:
../shared/research) go in the engine's own configuration (CONTAINERS_CONF, dockerd's flags),
never in egress's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import pytest

from conftest import clean_env, egress_command
from sandbox import container as ct
from sandbox.providers import PROVIDERS, select
from test_run import POLICY, egress_run, test_host  # noqa: F401 (a fixture)

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
        argv = ct.engine_argv(engine, "egress-x", network, spec, chosen, "/x/ca.pem")
        text = " ".join(argv)
        assert " ".join(ct.HARDENING) in text  # the same list for both engines
        assert f"--memory {chosen.memory} --memory-swap {chosen.memory}" in text
        assert "--user 1000:1000" in text and " ".join(network) in text
        assert f"type=bind,src={tmp_path},dst=/work " in text + " "
        assert f"src=/x/ca.pem,dst={ct.CA_PATH},ro" in text
        assert "AWS_SECRET_ACCESS_KEY" not in text  # the caller's environment stays outside
        assert argv[-2:] == ["img", "id"] and argv[-3] == "--"


def test_the_docker_holder_gets_the_same_hardening_with_a_user_of_its_own():
    flags = ct.holder_hardening()
    assert flags[flags.index("--user") + 1] == ct.HOLDER_USER != ct.USER
    assert [f for f in flags if f != ct.HOLDER_USER] == [f for f in ct.HARDENING if f != ct.USER]


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


# ------------------------------------------------------------------ local


def test_local_says_first_it_is_no_sandbox_and_still_reports_refusals(tmp_path, http_upstream):
    script = "curl -sS -o /dev/null -w '%{http_code} ' " + http_upstream.url("allowed.test") + \
             "; curl -sS -o /dev/null -w '%{http_code}' http://blocked.invalid/"
    result = egress_run(tmp_path, "sh", "-c", script, extra=["--provider", "local"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "200 403"
    assert result.stderr.splitlines()[0].startswith("egress: --provider local is NOT a sandbox")
    assert "EGRESS_BLOCKED blocked.invalid (not on the allow list)" in result.stderr


def test_local_keeps_exit_status_and_timeout(tmp_path):
    assert egress_run(tmp_path, "sh", "-c", "exit 7", extra=["--provider", "local"]).returncode == 7
    result = egress_run(tmp_path, "sleep", "60", extra=["--provider", "local", "--timeout", "1"])
    assert result.returncode == 124 and "timed out after 1 s" in result.stderr


def test_doctor_names_each_provider_without_overclaiming(tmp_path):
    result = subprocess.run([*egress_command(), "doctor", "--json"], capture_output=True, text=True, timeout=120,
                            env=clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state")))
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert "own network and writes confined; shares this kernel" in rows["provider namespace"]["detail"]
    assert "not a sandbox" in rows["local"]["detail"] and rows["local"]["fix"]
    podman = rows["provider podman"]
    if shutil.which("podman") and os.geteuid() == 0:
        assert podman["status"] == "warning" and "an escape lands on root" in podman["detail"]
        assert "unprivileged user" in podman["fix"]
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
                   "kill", "nslookup", "nc", "ip"):
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
    # A store of its own (the machine's is shared): `podman ps` then shows this module's containers only
    storage = work / "storage.conf"
    storage.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/graph"\nrunroot = "{work}/run"\n')
    engine = Engine("podman", {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}, IMAGE)
    try:
        _import_and_probe(engine, image_tarball)
        yield engine
    finally:
        for name in engine.containers():
            engine.run("rm", "--force", name)
        engine.run("rmi", "--force", IMAGE)


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


def in_container(tmp_path, engine: Engine, *command, extra=(), policy=None, timeout=180):
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    os.chmod(project, 0o777)  # the container's user is 1000; rootful engines map no ids
    kwargs = {"policy": policy} if policy else {}
    return egress_run(tmp_path, *command, extra=["--provider", engine.name, "--image", engine.image, *extra],
                      project=project, env=engine.env, timeout=timeout, **kwargs)


def test_container_runs_as_1000_on_a_read_only_root_with_the_project_at_work(tmp_path, engine):
    result = in_container(tmp_path, engine, "sh", "-c",
                          "id -u; echo no > /x; echo yes > /work/made && cat /work/made; pwd; exit 3")
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["1000", "yes", "/work"]
    assert "Read-only file system" in result.stderr
    assert (tmp_path / "project" / "made").read_text() == "yes\n"


def test_allowed_request_works_and_a_refused_one_prints_the_line(tmp_path, engine, http_upstream):
    script = ("curl -sS " + http_upstream.url("allowed.test") +
              "; curl -sS -o /dev/null -w '%{http_code}\\n' http://blocked.invalid/")
    result = in_container(tmp_path, engine, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from upstream\n403\n"
    assert "EGRESS_BLOCKED blocked.invalid (not on the allow list)" in result.stderr


def test_direct_tcp_and_raw_sockets_do_not_leave_the_namespace(tmp_path, engine, test_host):
    script = ("curl -fsS --noproxy '*' --max-time 20 http://198.51.100.2:8080/; echo tcp=$?; "
              "ping -c 1 -W 2 198.51.100.2 >/dev/null 2>&1; echo ping=$?; ls /sys/class/net")
    result = in_container(tmp_path, engine, "sh", "-c", script)
    lines = result.stdout.splitlines()
    assert "tcp=0" not in lines and "ping=0" not in lines, result.stdout
    assert lines[-1] == "lo"  # the namespace egress set up: nothing but lo
    # the direct connection is captured by egress (the namespace's redirect), refused and named
    assert "EGRESS_BLOCKED 198.51.100.2" in result.stderr
    time.sleep(0.5)
    assert not os.path.exists(test_host), open(test_host).read()


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
    assert result.stdout.strip() == "137", (result.returncode, result.stdout, result.stderr[-300:])


def test_timeout_kills_the_container(tmp_path, engine):
    result = in_container(tmp_path, engine, "sleep", "120", extra=["--timeout", "2"])
    assert result.returncode == 124 and "timed out after 2 s" in result.stderr
    assert engine.containers() == []  # nor a holder


def test_exit_statuses_are_the_shells(tmp_path, engine):
    assert in_container(tmp_path, engine, "sh", "-c", "exit 7").returncode == 7
    assert in_container(tmp_path, engine, "no-such-program").returncode == 127
    assert in_container(tmp_path, engine, "/etc/passwd").returncode == 126
    assert engine.containers() == []


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


# ------------------------------------------------------------------ docker: the holder


def test_a_killed_egress_leaves_no_container_behind(tmp_path, docker):
    """SIGKILL gives egress no chance to clean up: the holder's stdin closes, it exits, and the
    kernel ends its PID namespace, the command's container with it; --rm removes both."""
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o777)
    (tmp_path / "policy.toml").write_text(POLICY)
    (tmp_path / "launcher-tmp").mkdir()
    run = subprocess.Popen([*egress_command(), "run", "--policy", str(tmp_path / "policy.toml"), "--state-dir",
                            str(tmp_path / "state"), "--provider", "docker", "--image", docker.image, "--",
                            "sh", "-c", "echo started; sleep 300"], cwd=project, stdout=subprocess.PIPE, text=True,
                           env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path / "launcher-tmp"),
                                         **docker.env))
    try:
        assert run.stdout.readline() == "started\n"
        assert len(docker.containers()) == 2  # the command's and its holder
    finally:
        run.kill()
        run.wait()
        run.stdout.close()
    for _ in range(600):
        if docker.containers() == []:
            break
        time.sleep(0.1)
    assert docker.containers() == []


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
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o777)
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
        assert config["Config"]["User"] == ct.HOLDER_USER and host["Binds"] in (None, [])
        command = [name for name in docker.containers() if name not in holder][0]
        joined = json.loads(docker.run("inspect", command).stdout)[0]["HostConfig"]
        assert joined["NetworkMode"].startswith("container:")
        assert joined["PidMode"].startswith("container:")
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
