"""Real clients and installers inside `egress run`: what each one gets, and that it works.

wget over HTTPS (it ignores SSL_CERT_FILE), apt through a loopback Debian mirror (as root
it drops to _apt, whose ids do not exist in the sandbox), every installer failing at once
on a refused host (no retry storm), and node, whose built-in fetch() reads the proxy
variables only from Node 22.21/24.5 on. Upstreams listen on the host's 127.0.0.1; the
names resolve there only through the proxy's --resolve. A test whose client is not
installed is skipped with a reason naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
from email.utils import formatdate
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_run import egress_run, namespaces_available  # noqa: F401 (an autouse fixture: skips without namespaces)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")


def need(tool: str, why: str = "") -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed{why}")
    return path


def audit(tmp_path: Path) -> list[dict]:
    path = tmp_path / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------- wget


def test_wget_fetches_over_https_trusting_the_runs_bundle_and_keeps_the_users_wgetrc(tmp_path, https_upstream,
                                                                                      test_ca_file):
    wget = need("wget", " (scripts/test installs Debian's wget)")
    # The user's own ~/.wgetrc: its user agent still applies; its proxy and CA give way to egress's
    # (a proxy on the sandbox's own loopback port 9 would refuse, a missing CA file would fail).
    (tmp_path / ".wgetrc").write_text("user_agent = agent-from-the-users-wgetrc\n"
                                      "https_proxy = http://127.0.0.1:9/\nca_certificate = /nonexistent/ca.pem\n")
    result = egress_run(tmp_path, wget, "-q", "-O", "-", https_upstream.url("allowed.test"),
                        upstream_ca=test_ca_file)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from upstream\n"
    assert https_upstream.requests[-1]["headers"]["User-Agent"] == "agent-from-the-users-wgetrc"
    assert (tmp_path / ".wgetrc").read_text().startswith("user_agent")  # the user's file is not touched


# ----------------------------------------------------------------------------- apt


class _Mirror(ThreadingHTTPServer):
    daemon_threads = True


class _MirrorHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.paths.append(self.path)
        super().do_GET()


def build_deb_repository(root: Path, work: Path) -> bytes:
    """A flat Debian repository in ``root``: one real .deb (dpkg-deb), Packages, and a Release
    written by hand (apt-ftparchive is in apt-utils, seldom installed). Returns the .deb's bytes."""
    package = work / "egress-hello"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "usr/share/doc/egress-hello").mkdir(parents=True)
    (package / "usr/share/doc/egress-hello/README").write_text("built by egress's tests\n")
    control = ("Package: egress-hello\nVersion: 1.0\nArchitecture: all\n"
               "Maintainer: egress tests <tests@egress.invalid>\nDescription: a package egress's tests build\n")
    (package / "DEBIAN/control").write_text(control)
    root.mkdir()
    deb = root / "egress-hello_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(package), str(deb)], check=True,
                   capture_output=True)
    data = deb.read_bytes()
    packages = (control + f"Filename: ./{deb.name}\nSize: {len(data)}\n"
                f"SHA256: {hashlib.sha256(data).hexdigest()}\n\n").encode()
    (root / "Packages").write_bytes(packages)
    (root / "Release").write_text(f"Date: {formatdate(usegmt=True)}\nSHA256:\n"
                                  f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n")
    return data


@pytest.fixture
def apt_tools():
    for tool in ("apt-get", "dpkg-deb"):
        need(tool)


def isolated_apt(tmp_path: Path, source: str) -> Path:
    """An apt configuration of the test's own, in the project (the command can write there):
    its sources, lists, caches and dpkg status; the machine's apt state is never read or written."""
    apt = tmp_path / "project" / "apt"
    for folder in ("sources.list.d", "state/lists/partial", "cache/archives/partial"):
        (apt / folder).mkdir(parents=True)
    (apt / "sources.list").write_text(source + "\n")
    (apt / "status").write_text("")
    (apt / "apt.conf").write_text(textwrap.dedent(f"""\
        Dir::Etc::sourcelist "{apt}/sources.list";
        Dir::Etc::sourceparts "{apt}/sources.list.d";
        Dir::State "{apt}/state";
        Dir::State::status "{apt}/status";
        Dir::Cache "{apt}/cache";
        Acquire::Languages "none";
        // The user's own proxies, for every host and for one: egress's must win over them.
        Acquire::http::Proxy "http://127.0.0.1:9/";
        Acquire::https::Proxy "http://127.0.0.1:9/";
        Acquire::http::Proxy::mirror.test "DIRECT";
        Acquire::https::Proxy::mirror.test "DIRECT";
        """))
    return apt / "apt.conf"


def apt_dump(config: str | None) -> list[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"}
    if config:
        env["APT_CONFIG"] = config
    return subprocess.run(["apt-config", "dump"], capture_output=True, text=True, env=env, check=True,
                          timeout=60).stdout.splitlines()


EGRESS_APT_KEYS = ("APT::Sandbox::User", "Acquire::Retries", "Acquire::http::Proxy", "Acquire::https::Proxy",
                   "Acquire::https::CAInfo", "Dir::Etc::parts", "Dir::Etc::main")


def test_the_runs_apt_configuration_is_the_systems_with_egresss_settings_last(tmp_path):
    need("apt-config")
    from sandbox.environment import command_environment, write_files

    bundle = tmp_path / "bundle.pem"
    bundle.write_text("")
    files: dict = {}
    env = command_environment({"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, proxy_url="http://127.0.0.1:3128",
                              ca_bundle=bundle, tmpdir=tmp_path, files=files)
    write_files(files)
    system, run = apt_dump(None), apt_dump(env["APT_CONFIG"])

    ours = tuple(k.lower() + c for k in EGRESS_APT_KEYS for c in " :") + ('acquire::http "', 'acquire::https "')

    def others(lines):  # without egress's keys (and the two sections that hold some of them)
        return [line for line in lines if not line.lower().startswith(ours)]

    assert others(run) == others(system)  # every setting of the system's own files, as apt reads them
    for line in ('APT::Sandbox::User "root";', 'Acquire::Retries "0";', 'Acquire::http::Proxy "http://127.0.0.1:3128";',
                 'Acquire::https::Proxy "http://127.0.0.1:3128";', f'Acquire::https::CAInfo "{bundle}";'):
        assert line in run


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_apt_get_downloads_a_package_through_egress_from_a_loopback_mirror(tmp_path, apt_tools, test_ca,
                                                                          test_ca_file, scheme):
    deb = build_deb_repository(tmp_path / "mirror", tmp_path / "build")
    server = _Mirror(("127.0.0.1", 0), partial(_MirrorHandler, directory=str(tmp_path / "mirror")))
    server.paths = []
    if scheme == "https":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        test_ca.issue_cert("mirror.test").configure_cert(context)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = f"deb [trusted=yes] {scheme}://mirror.test:{server.server_address[1]}/ ./"
        config = isolated_apt(tmp_path, source)  # given as the caller's APT_CONFIG: egress includes it
        result = egress_run(tmp_path, "sh", "-c", "apt-get -q update && apt-get -q download egress-hello",
                            policy='allow = ["mirror.test"]\nallow_private = ["mirror.test"]\n',
                            extra=["--resolve", "mirror.test:127.0.0.1"], upstream_ca=test_ca_file,
                            env={"APT_CONFIG": str(config)})
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "project" / "egress-hello_1.0_all.deb").read_bytes() == deb
    assert server.paths[-1] == "/./egress-hello_1.0_all.deb", server.paths  # it came from the mirror
    assert "EGRESS" not in result.stderr


# ---------------------------------------------- installers fail at once on a refused host


def _cargo_env(tmp_path: Path, base: str) -> dict:
    # rustup's proxy (~/.cargo/bin/cargo) finds its toolchains in RUSTUP_HOME; cargo writes its
    # registry cache in CARGO_HOME, which must be writable inside: the project.
    env = {"CARGO_HOME": str(tmp_path / "project" / ".cargo")}
    rustup_home = os.environ.get("RUSTUP_HOME") or os.path.expanduser("~/.rustup")
    if os.path.isdir(rustup_home):
        env["RUSTUP_HOME"] = rustup_home
    return env


def _yarn_berry() -> str:
    yarn = need("yarn")
    version = subprocess.run([yarn, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    if version.startswith("1."):
        pytest.skip(f"yarn {version} retries a refused host 5 times (13 s here) and has no setting to stop it")
    return yarn


def _yarn_env(tmp_path: Path, base: str) -> dict:
    (tmp_path / "project").mkdir(exist_ok=True)
    (tmp_path / "project" / "package.json").write_text('{"name": "p", "version": "1.0.0"}\n')
    return {"YARN_NPM_REGISTRY_SERVER": base}


def _uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.skip("uv is not installed (pip install -e '.[test]' installs it)")
    return find_uv_bin()


# Each: how to find the tool, the command that asks the refused https://blocked.test:PORT for
# something, and the caller's extra environment (or None). Measured by hand (egress run,
# a refused host; about 0.6 s of each is the proxy's lazy start): pip 1 request 1.7 s, uv 4
# requests 10.7 s before UV_HTTP_RETRIES=0 and 1 request 1.1 s after, npm 1 / 1.4 s,
# cargo 1 / 1.1 s, git 1 / 1.0 s, wget 1 / 1.1 s, apt-get 1 / 1.6 s, go 1.19 1 / 1.4 s, yarn 4.18
# 1 / 1.3 s (yarn 1.22: 5 requests, 13 s).
INSTALLERS = {
    "pip": (lambda: sys.executable,
            lambda tool, base: ["env", "PIP_CONFIG_FILE=/dev/null", tool, "-m", "pip", "download", "--no-deps",
                                "-d", ".", "--index-url", f"{base}/simple", "six"], None),
    "uv": (_uv, lambda tool, base: ["sh", "-c", f"echo six | {tool} pip compile --no-config --no-cache "
                                                f"--python {sys.executable} --index-url {base}/simple -"], None),
    "npm": (partial(need, "npm"),
            lambda tool, base: [tool, "view", "left-pad", "--registry", f"{base}/", "--userconfig", "/dev/null"],
            None),
    "cargo": (partial(need, "cargo"), lambda tool, base: [tool, "search", "--index", f"sparse+{base}/", "left-pad"],
              _cargo_env),
    "git": (partial(need, "git"), lambda tool, base: [tool, "ls-remote", f"{base}/repo.git"],
            lambda tmp_path, base: {"GIT_CONFIG_NOSYSTEM": "1"}),
    "wget": (partial(need, "wget"), lambda tool, base: [tool, "-O", "-", f"{base}/simple/six/"], None),
    "apt-get": (partial(need, "apt-get"), lambda tool, base: [tool, "-q", "--error-on=any", "update"],
                lambda tmp_path, base: {"APT_CONFIG": str(isolated_apt(tmp_path, f"deb [trusted=yes] {base}/ ./"))}),
    "yarn": (_yarn_berry, lambda tool, base: [tool, "npm", "info", "left-pad"], _yarn_env),
    "go": (partial(need, "go"),
           lambda tool, base: ["env", f"GOPROXY={base}", "GOSUMDB=off", "GOTOOLCHAIN=local", "GOFLAGS=",
                               tool, "mod", "download", "example.test/module@v1.0.0"], None),
}


@pytest.mark.parametrize("name", sorted(INSTALLERS))
def test_an_installer_fails_at_once_on_a_refused_host_and_egress_says_so_once(tmp_path, https_upstream, name):
    find, command, extra_env = INSTALLERS[name]
    tool = find()
    base = f"https://blocked.test:{https_upstream.port}"
    result = egress_run(tmp_path, *command(tool, base), extra=["--audit-log", str(tmp_path / "audit.jsonl")],
                        env=extra_env(tmp_path, base) if extra_env else None, timeout=180)
    assert result.returncode != 0, result.stdout + result.stderr
    assert re.findall(r"^EGRESS_BLOCKED .*$", result.stderr, re.M) == [
        "EGRESS_BLOCKED blocked.test (not on the allow list)"], result.stderr
    # What a retry storm looks like without a stopwatch: the requests the proxy refused.
    # (uv without UV_HTTP_RETRIES=0: 4.)
    refused = [e for e in audit(tmp_path) if e["host"] == "blocked.test" and e["decision"] == "block"]
    assert 1 <= len(refused) <= 2, refused
    assert https_upstream.connections == 0


# ----------------------------------------------------------------------------- node


def node_version(node: str) -> tuple[int, ...]:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return tuple(int(part) for part in out.lstrip("v").split(".")[:3])


def follows_env_proxy(version: tuple[int, ...]) -> bool:
    """NODE_USE_ENV_PROXY=1 makes fetch() and http/https use HTTPS_PROXY: Node 22.21+, 24.5+."""
    return version >= (24, 5) or (22, 21) <= version < (23,)


FETCH = "fetch(process.argv[1]).then(r => r.text()).then(t => process.stdout.write(t), e => { console.error(e.cause || e); process.exit(3) })"


def test_node_fetch_goes_through_egress_where_node_follows_node_use_env_proxy(tmp_path, https_upstream, test_ca_file):
    node = need("node")
    version = node_version(node)
    if not follows_env_proxy(version):
        pytest.skip(f"node v{'.'.join(map(str, version))} ignores NODE_USE_ENV_PROXY (Node 22.21+ or 24.5+ follows it)")
    ok = egress_run(tmp_path, node, "-e", FETCH, https_upstream.url("allowed.test"), upstream_ca=test_ca_file)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "hello from upstream\n"
    refused = egress_run(tmp_path, node, "-e", FETCH, https_upstream.url("blocked.test"))
    assert refused.returncode == 3
    assert "EGRESS_BLOCKED blocked.test (not on the allow list)" in refused.stderr
    assert https_upstream.connections == 1


HINT = re.compile(r"^egress: (\S+) failed without a single connection through egress's proxy, after trying "
                  r"to connect directly.*$", re.M)


def test_a_node_command_that_failed_going_around_the_proxy_gets_a_hint(tmp_path):
    node = need("node")
    # NO_PROXY sends fetch() around the proxy whatever node's version: as node 20 does for every host.
    direct = egress_run(tmp_path, node, "-e", FETCH, "https://direct.test/", env={"NO_PROXY": "direct.test"})
    assert direct.returncode == 3, direct.stderr
    # Captured (tests/run/test_run_capture.py): no longer around the proxy, so a line, not the hint,
    # which is left for kernels without nf_tables (the capture then is not made).
    assert "EGRESS_BLOCKED direct.test (not on the allow list)" in direct.stderr
    assert not HINT.findall(direct.stderr), direct.stderr


def test_the_hint_is_not_given_when_the_command_did_not_go_around_the_proxy(tmp_path, http_upstream, curl_path):
    node = need("node")
    # Failed without touching the network.
    offline = egress_run(tmp_path, node, "-e", "process.exit(3)")
    # Went around the proxy, but also through it (a child curl): egress saw it, so it is no such client.
    through = f"require('child_process').execFileSync('curl', ['-s', '{http_upstream.url('allowed.test')}']); {FETCH}"
    mixed = egress_run(tmp_path, node, "-e", through, "https://direct.test/", env={"NO_PROXY": "direct.test"})
    # Went around the proxy and succeeded (status 0): nothing to explain.
    fine = egress_run(tmp_path, node, "-e", FETCH.replace("process.exit(3)", "process.exit(0)"), "https://direct.test/",
                      env={"NO_PROXY": "direct.test"})
    assert (offline.returncode, mixed.returncode, fine.returncode) == (3, 3, 0), mixed.stderr
    assert len(http_upstream.requests) == 1
    for result in (offline, mixed, fine):
        assert not HINT.search(result.stderr), result.stderr


def test_any_command_that_failed_going_around_the_proxy_gets_the_general_hint(tmp_path, curl_path):
    result = egress_run(tmp_path, "curl", "-sS", "--noproxy", "*", "https://direct.test/")
    assert result.returncode != 0
    assert "EGRESS_BLOCKED direct.test (not on the allow list)" in result.stderr  # captured: named
    assert not HINT.findall(result.stderr), result.stderr
