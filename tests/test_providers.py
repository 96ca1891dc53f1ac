"""`egress run --provider`: local (no sandbox, said first), podman and docker (a hardened container
in the network namespace egress made), and egress doctor's words for each.

The podman tests run a real rootful podman with an image imported from a tarball made here (a
static busybox, and curl with its libraries copied from this machine: no registry). This
machine's engine settings (runc, cgroupfs, no default ulimits: ../shared/research) go in a
containers.conf named by CONTAINERS_CONF, the engine's own variable, never in egress's flags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import clean_env, egress_command, stop_warm_servers
from sandbox import container as ct
from sandbox.providers import PROVIDERS, select
from test_run import egress_run, test_host, user_venv  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the providers are tested on Linux")

IMAGE = f"localhost/egress-provider-test:{os.getpid()}"  # one per session: two sessions may share the engine


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
    for chosen in (ct.ContainerSpec("img"), ct.ContainerSpec("img", [f"{tmp_path}:/data:rw"], ["cache"], "1", "64m")):
        argv = ct.engine_argv("podman", "egress-x", "/proc/1/ns/net", spec, chosen, "/x/ca.pem")
        text = " ".join(argv)
        assert " ".join(ct.HARDENING) in text
        assert f"--memory {chosen.memory} --memory-swap {chosen.memory}" in text
        assert "--user 1000:1000" in text and "--network ns:/proc/1/ns/net" in text
        assert f"type=bind,src={tmp_path},dst=/work " in text + " "
        assert f"src=/x/ca.pem,dst={ct.CA_PATH},ro" in text
        assert "AWS_SECRET_ACCESS_KEY" not in text  # the caller's environment stays outside
        assert argv[-2:] == ["img", "id"] and argv[-3] == "--"


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
    assert ct.covers(spec, chosen, shown) == [
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
        assert "--provider namespace" in podman["fix"]
    docker = rows["provider docker"]
    assert docker["status"] != "ok" and docker["fix"]  # a root daemon, or none: never plainly ok
    for row in rows.values():
        if row["name"].startswith("provider") or row["name"] == "local":
            assert "isolated" not in row["detail"]


# ------------------------------------------------------------------ podman, for real


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    """(environment for egress run, image): a real rootful podman and an image made here."""
    engine = shutil.which("podman")
    runc = shutil.which("runc") or ("/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else None)
    if engine is None or runc is None or not os.path.exists("/bin/busybox") or not shutil.which("curl"):
        pytest.skip("podman, runc, busybox-static and curl are needed (scripts/test installs them as root)")
    if os.geteuid() != 0:
        pytest.skip("podman is tested rootful here (an unprivileged podman cannot join egress's namespace)")
    work = tmp_path_factory.mktemp("podman")
    conf = work / "containers.conf"  # this machine's engine settings: not egress's business
    conf.write_text(f'[containers]\ndefault_ulimits = []\n[engine]\nruntime = "{runc}"\ncgroup_manager = "cgroupfs"\n')
    env = {"CONTAINERS_CONF": str(conf)}
    root = work / "root"
    for folder in ("bin", "etc", "tmp", "work", "persist"):
        (root / folder).mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "ls", "echo", "cat", "id", "seq", "sleep", "head", "tail", "touch", "ping", "wc", "true",
                   "tr", "stat", "mkdir"):
        (root / "bin" / applet).symlink_to("busybox")
    curl = shutil.which("curl")
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
    made = subprocess.run([engine, "import", str(tarball), IMAGE], capture_output=True, text=True,
                          env={**os.environ, **env})
    if made.returncode != 0:
        pytest.skip(f"podman cannot import an image here: {made.stderr.strip()[:200]}")
    probe = subprocess.run([engine, "run", "--rm", "--network", "none", IMAGE, "true"], capture_output=True,
                           text=True, env={**os.environ, **env})
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()[:200]}")
    yield env, IMAGE, tarball
    subprocess.run([engine, "rmi", "--force", IMAGE], capture_output=True, env={**os.environ, **env})


OWNER = 4242  # the projects' owner: not root, not the container's 1000


def in_podman(tmp_path, podman, *command, extra=(), policy=None, timeout=180, upstream_ca=None, env=None):
    engine_env, image, _ = podman
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    os.chown(project, OWNER, OWNER)  # the container's user (1000) writes as the project's owner
    kwargs = {"policy": policy} if policy else {}
    return egress_run(tmp_path, *command, extra=["--provider", "podman", "--image", image, *extra],
                      project=project, env={**engine_env, **(env or {})}, timeout=timeout, upstream_ca=upstream_ca,
                      **kwargs)


def test_container_runs_as_1000_on_a_read_only_root_with_the_project_at_work(tmp_path, podman):
    result = in_podman(tmp_path, podman, "sh", "-c",
                       "id -u; echo no > /x; echo yes > /work/made && cat /work/made; pwd; exit 3")
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["1000", "yes", "/work"]
    assert "Read-only file system" in result.stderr
    assert (tmp_path / "project" / "made").read_text() == "yes\n"


def test_allowed_request_works_and_a_refused_one_prints_the_line(tmp_path, podman, http_upstream):
    script = ("curl -sS " + http_upstream.url("allowed.test") +
              "; curl -sS -o /dev/null -w '%{http_code}\\n' http://blocked.invalid/")
    result = in_podman(tmp_path, podman, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from upstream\n403\n"
    assert "EGRESS_BLOCKED blocked.invalid (not on the allow list)" in result.stderr


def test_direct_tcp_and_raw_sockets_do_not_leave_the_namespace(tmp_path, podman, test_host):
    script = ("curl -fsS --noproxy '*' --max-time 20 http://198.51.100.2:8080/; echo tcp=$?; "
              "ping -c 1 -W 2 198.51.100.2 >/dev/null 2>&1; echo ping=$?; ls /sys/class/net")
    result = in_podman(tmp_path, podman, "sh", "-c", script)
    lines = result.stdout.splitlines()
    assert "tcp=0" not in lines and "ping=0" not in lines, result.stdout
    assert lines[-1] == "lo"  # the namespace egress made: nothing but lo
    # the direct connection is captured by egress (the namespace's redirect), refused and named
    assert "EGRESS_BLOCKED 198.51.100.2" in result.stderr
    time.sleep(0.5)
    assert not os.path.exists(test_host), open(test_host).read()


def test_a_fork_bomb_stops_at_the_pids_limit(tmp_path, podman):
    script = "n=0; while [ $n -lt 700 ]; do sleep 60 & n=$((n+1)); done; echo started"
    result = in_podman(tmp_path, podman, "sh", "-c", script, extra=["--timeout", "60"])
    assert "can't fork" in result.stderr or "Resource temporarily unavailable" in result.stderr, result.stderr[-500:]


def test_the_memory_cap_holds(tmp_path, podman):
    policy = 'allow = ["allowed.test"]\n[container]\nmemory = "64m"\n'
    # one 200 MB line held by tail: more than the cap, and swap is capped equally: killed (128+9)
    result = in_podman(tmp_path, podman, "sh", "-c", "head -c 200000000 /dev/zero | tail -n 1 >/dev/null; echo $?",
                       policy=policy)
    assert result.stdout.strip() == "137", (result.returncode, result.stdout, result.stderr[-300:])


def test_timeout_kills_the_container(tmp_path, podman):
    result = in_podman(tmp_path, podman, "sleep", "120", extra=["--timeout", "2"])
    assert result.returncode == 124 and "timed out after 2 s" in result.stderr
    left = subprocess.run(["podman", "ps", "-q", "--filter", "name=egress-"], capture_output=True, text=True,
                          env={**os.environ, **podman[0]})
    assert left.stdout.strip() == ""


def test_mounts_are_read_only_unless_rw_and_persist_keeps_a_volume(tmp_path, podman):
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o777)
    volume = f"egress-test-{os.urandom(4).hex()}"
    try:
        first = in_podman(tmp_path, podman, "sh", "-c", "echo a > /ro/x; echo b > /rw/x && echo kept > "
                          f"/persist/{volume}/file", extra=["--mount", f"{data}:/ro", "--mount", f"{data}:/rw:rw",
                                                            "--persist", volume])
        assert "Read-only file system" in first.stderr, first.stderr
        assert (data / "x").read_text() == "b\n"
        second = in_podman(tmp_path, podman, "cat", f"/persist/{volume}/file", extra=["--persist", volume])
        assert second.stdout == "kept\n", second.stderr
    finally:
        subprocess.run(["podman", "volume", "rm", "--force", volume], capture_output=True,
                       env={**os.environ, **podman[0]})


# ------------------------------------------------------------------ podman: secrets and the project's owner


FILE_SECRET = "egress-test-secret-9c2f4b7e1a0d5e3186f2"


def test_brokered_secrets_reach_only_their_host_and_never_the_container(tmp_path, podman, https_upstream,
                                                                        test_ca_file):
    from test_credentials import GITHUB

    project = tmp_path / "project"
    project.mkdir()
    (project / ".token").write_text(FILE_SECRET + "\n")  # inside /work: the real one must stay covered
    policy = ('allow = ["allowed.test", "other.test"]\nallow_private = ["allowed.test", "other.test"]\n'
              '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
              f'[[credentials.secret]]\nfile = "{project / ".token"}"\nhosts = ["allowed.test"]\n')
    headers = '-H "Authorization: token $GITHUB_TOKEN" -H "X-File: $(cat /work/.token)"'
    script = (f'echo "$GITHUB_TOKEN"; cat /work/.token; '
              f'curl -sS {headers} {https_upstream.url("allowed.test")}; '
              f'curl -sS -o /dev/null -w "%{{http_code}}\\n" {headers} {https_upstream.url("other.test")}; '
              'tr "\\0" "\\n" < /proc/1/environ; '
              'touch /work/ready || exit 9; while [ ! -e /work/go ]; do sleep 0.1; done')
    inspected, ended = [], threading.Event()

    def inspect():  # while the container runs: what the engine keeps of it
        try:
            while not (project / "ready").exists():
                if ended.wait(0.1):
                    return
            engine = {**os.environ, **podman[0]}
            ids = subprocess.run(["podman", "ps", "-q", "--filter", f"ancestor={podman[1]}"], capture_output=True,
                                 text=True, env=engine).stdout.split()
            inspected.append(subprocess.run(["podman", "inspect", *ids], capture_output=True, text=True,
                                            env=engine).stdout)
        finally:
            (project / "go").touch()

    watcher = threading.Thread(target=inspect)
    watcher.start()
    try:
        result = in_podman(tmp_path, podman, "sh", "-c", script, policy=policy, upstream_ca=test_ca_file,
                           env={"GITHUB_TOKEN": GITHUB})
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
    assert (project / ".token").read_text() == FILE_SECRET + "\n"


def test_files_made_in_work_belong_to_the_projects_owner_and_nothing_else_is_writable(tmp_path, podman):
    project = tmp_path / "project"
    project.mkdir()
    (project / "link").symlink_to("/etc/passwd")  # a way out of /work, were the host's /etc shown
    script = ("id -u; stat -c %u:%g /work; echo a > /work/made && mkdir /work/sub && echo b > /work/sub/f; "
              "for p in /x /etc/x /work/../y /work/link /bin/x; do echo no > $p && echo wrote $p; done; true")
    result = in_podman(tmp_path, podman, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["1000", "1000:1000"]  # the owner's project, as the container's user sees it
    for made in ("made", "sub", "sub/f"):
        info = (project / made).lstat()
        assert (info.st_uid, info.st_gid) == (OWNER, OWNER), made
    assert result.stderr.count("Read-only file system") == 5, result.stderr
    assert not os.path.exists(tmp_path / "y")
    assert left_views() == []  # the view is detached and its folder gone once the run ends


def test_a_project_owned_by_root_is_refused_before_anything_runs(tmp_path, podman):
    env, image, _ = podman
    project = tmp_path / "project"
    project.mkdir()
    result = egress_run(tmp_path, "touch", "/work/ran", extra=["--provider", "podman", "--image", image],
                        project=project, env=env)
    assert result.returncode == 125 and "is owned by root" in result.stderr, result.stderr
    assert not (project / "ran").exists()


def test_a_project_the_owner_mapping_cannot_be_made_for_runs_nothing(tmp_path, podman):
    # ramfs has no idmapped mounts: the run must stop, not hand uid 1000 a project it cannot write
    # (or, made writable for it, one everybody can write).
    env, image, _ = podman
    project = tmp_path / "project"
    project.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0755", "ramfs", str(project)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.strip()}")
    try:
        os.chown(project, OWNER, OWNER)
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

    env, image, _ = podman
    project = tmp_path / "project"
    project.mkdir()
    os.chown(project, OWNER, OWNER)
    (tmp_path / "policy.toml").write_text('allow = ["allowed.test"]\n')
    run = subprocess.Popen([*egress_command(), "run", "--policy", str(tmp_path / "policy.toml"), "--state-dir",
                            str(tmp_path / "state"), "--provider", "podman", "--image", image, "--", "sh", "-c",
                            "touch /work/ready; sleep 600"], cwd=project, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), **env))
    engine = {**os.environ, **env}
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
        ids = subprocess.run(["podman", "ps", "-q", "--filter", f"ancestor={image}"], capture_output=True, text=True,
                             env=engine).stdout.split()
        subprocess.run(["podman", "rm", "--force", *ids], capture_output=True, env=engine)  # (the orphaned one)
    assert in_podman(tmp_path, podman, "true").returncode == 0
    assert not os.path.exists(os.path.join(ct.RUNTIME_DIR, left[0]))
    assert f"/{left[0]}/work " not in open("/proc/self/mountinfo").read()


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
    import tempfile

    venv, nobody = user_venv
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    home = tempfile.mkdtemp(prefix="egress-user-home-")
    try:
        os.chmod(home, 0o755)
        project = os.path.join(home, "project")
        os.mkdir(project)
        for path in (home, project):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
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
    finally:
        stop_warm_servers(Path(home))
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def rootless(podman, tmp_path):
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
        shutil.copy(podman[0]["CONTAINERS_CONF"], conf)
        os.chmod(conf, 0o644)
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home, "XDG_RUNTIME_DIR": runtime,
               "CONTAINERS_CONF": conf}

        def as_user(*argv, wait=True, **kwargs):
            start = subprocess.run if wait else subprocess.Popen
            return start(list(argv), user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=env, cwd=home,
                         **({"capture_output": True, "text": True, "timeout": 120} if wait else {}), **kwargs)

        tarball = os.path.join(home, "image.tar")
        shutil.copy(podman[2], tarball)
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


# ------------------------------------------------------------------ docker: the same code path


def test_docker_runs_the_same_hardened_container(tmp_path):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("docker: no docker daemon answers here")
    result = egress_run(tmp_path, "id", "-u", extra=["--provider", "docker", "--image",
                                                      os.environ.get("EGRESS_TEST_DOCKER_IMAGE", "busybox")])
    assert result.stdout.strip() == "1000", result.stderr
