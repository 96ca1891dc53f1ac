"""The environment a sandboxed command gets.

Every proxy and CA variable real clients read is *set*, never inherited: this
machine (like many CI images) exports its own ``SSL_CERT_FILE``,
``REQUESTS_CA_BUNDLE``, ``PIP_CERT``... which would otherwise win. Which client
reads which spelling is recorded in shared/research/real-clients.md: curl ignores
upper-case ``HTTP_PROXY``, wget ignores upper-case names, so both are set.

Two clients read no variable for what they need, only a file named by one: Debian's wget
(GnuTLS) ignores ``SSL_CERT_FILE``, and apt takes its proxy and CA from its configuration
(where a system file may name another proxy), so each gets a file of its own in the run's
temporary folder (``WGETRC``, ``APT_CONFIG``), the user's own settings first and egress's after.
"""

from __future__ import annotations

import os

# Paths are str (os.PathLike taken): `egress run` never imports pathlib (egress.proxy.ca says why).

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy",
                   "npm_config_proxy", "npm_config_https_proxy", "CARGO_HTTP_PROXY", "PIP_PROXY",
                   "YARN_HTTP_PROXY", "YARN_HTTPS_PROXY")
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO",
                "CARGO_HTTP_CAINFO", "npm_config_cafile", "NODE_EXTRA_CA_CERTS", "DENO_CERT",
                "AWS_CA_BUNDLE", "HTTPLIB2_CA_CERTS", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
                "NIX_SSL_CERT_FILE", "CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE", "YARN_HTTPS_CA_FILE_PATH")
# Variables that would point clients at another trust store or proxy setting.
DROPPED = ("SSL_CERT_DIR", "GIT_SSL_CAPATH", "REQUEST_METHOD", "NO_PROXY", "no_proxy",
           "npm_config_noproxy", "PIP_CONFIG_FILE", "GIT_PROXY_COMMAND")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")

# Installs fail in about a second instead of retrying for minutes (pip: 8.6 s -> 1 s, npm > 40 s -> 0.8 s).
FAIL_FAST = {
    "PIP_RETRIES": "0",
    "PIP_TIMEOUT": "15",
    "PIP_DEFAULT_TIMEOUT": "15",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "npm_config_fetch_retries": "0",
    "npm_config_fetch_timeout": "30000",
    "npm_config_audit": "false",
    "npm_config_fund": "false",
    "npm_config_update_notifier": "false",
    "CARGO_NET_RETRY": "0",
    "CARGO_HTTP_TIMEOUT": "30",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_HTTP_LOW_SPEED_LIMIT": "1000",
    "GIT_HTTP_LOW_SPEED_TIME": "30",
    # uv retries a refused host 3 times with back-off: 4 requests, 10.7 s -> 1 request, 1.1 s.
    "UV_HTTP_RETRIES": "0",
}

# Runtimes commonly live here; added to PATH when they exist.
RUNTIME_DIRS = ("/opt/homebrew/bin", "/usr/local/bin", "~/.nvm/current/bin", "~/.local/share/fnm/aliases/default/bin",
                "~/.volta/bin", "~/.local/share/mise/shims", "~/.asdf/shims", "~/.pyenv/shims", "~/.rbenv/shims",
                "~/.cargo/bin", "~/go/bin", "~/.bun/bin", "~/.deno/bin", "~/.local/bin")

def trust_bundle(roots: list[str], egress_ca: str | os.PathLike, target: str | os.PathLike) -> str | os.PathLike:
    """Write one bundle: the roots egress trusts upstream (egress.proxy.trust: the system's CAs and
    --upstream-ca; passthrough hosts are verified by the command itself) and egress's CA."""
    parts = [_read(path, errors="replace") for path in roots]
    parts.append(_read(egress_ca))
    _write(target, "\n".join(parts))
    return target


def _read(path: str | os.PathLike, errors: str = "strict") -> str:
    with open(path, encoding="utf-8", errors=errors) as f:
        return f.read()


def _write(path: str | os.PathLike, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def command_environment(base: dict[str, str], *, proxy_url: str | None, ca_bundle: str | os.PathLike | None,
                        tmpdir: str | os.PathLike, files: dict, home: str | None = None) -> dict[str, str]:
    """The command's environment: ``base`` with every proxy, CA and cache variable decided here.

    The files it names (wgetrc, apt's configuration) are put in ``files`` ({path: text, or None
    for a folder}) for :func:`write_files`: the launcher writes them while the sandbox is being
    made, before the command can start."""
    env = {k: v for k, v in base.items()
           if k not in PROXY_VARIABLES + CA_VARIABLES + DROPPED and not k.startswith("GIT_CONFIG_")}

    no_proxy = [n for n in (base.get("NO_PROXY") or base.get("no_proxy") or "").split(",") if n.strip()]
    no_proxy += [n for n in LOCAL_NAMES if n not in no_proxy]
    env["NO_PROXY"] = env["no_proxy"] = env["npm_config_noproxy"] = ",".join(no_proxy)

    if proxy_url:
        for name in PROXY_VARIABLES:
            env[name] = proxy_url
        # git reads http.proxy from its config; passed without touching the user's files.
        env.update({"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.proxy", "GIT_CONFIG_VALUE_0": proxy_url})
        # node's built-in fetch() and http/https read the proxy variables only when asked (Node
        # 22.21+ and 24.5+; older versions ignore this and connect directly: direct_connection_hint).
        env["NODE_USE_ENV_PROXY"] = "1"
    if ca_bundle:
        for name in CA_VARIABLES:
            env[name] = str(ca_bundle)
    env.update(client_files(tmpdir, base, home or base.get("HOME"), proxy_url=proxy_url, ca_bundle=ca_bundle,
                            no_proxy=env["no_proxy"], files=files))

    env.update(FAIL_FAST)
    tmpdir = os.fspath(tmpdir)
    caches = os.path.join(tmpdir, "cache")
    env.update({
        "TMPDIR": tmpdir, "TMP": tmpdir, "TEMP": tmpdir,
        "PIP_CACHE_DIR": os.path.join(caches, "pip"), "npm_config_cache": os.path.join(caches, "npm"),
        "YARN_CACHE_FOLDER": os.path.join(caches, "yarn"), "XDG_CACHE_HOME": caches,
        "GOCACHE": os.path.join(caches, "go-build"), "GOMODCACHE": os.path.join(caches, "go-mod"),
    })
    env["PATH"] = extended_path(base.get("PATH", "/usr/local/bin:/usr/bin:/bin"), home or base.get("HOME"))
    return env


APT_PARTS = "/etc/apt/apt.conf.d/"  # apt's defaults for Dir::Etc::parts and Dir::Etc::main
APT_MAIN = "/etc/apt/apt.conf"


def client_files(tmpdir: str | os.PathLike, base: dict[str, str], home: str | None, *, proxy_url: str | None,
                 ca_bundle: str | os.PathLike | None, no_proxy: str, files: dict) -> dict[str, str]:
    """The wget and apt configuration files for the run, put in ``files`` (see
    command_environment); returns the variables naming them."""
    env = {}
    tmpdir = os.fspath(tmpdir)
    if proxy_url:
        env["WGETRC"] = wgetrc(os.path.join(tmpdir, "wgetrc"), _user_wgetrc(base, home), proxy_url=proxy_url,
                               ca_bundle=ca_bundle, no_proxy=no_proxy, files=files)
    if os.path.isdir(APT_PARTS) and _apt_quotable(tmpdir):
        env["APT_CONFIG"] = apt_config(os.path.join(tmpdir, "apt.conf"), os.path.join(tmpdir, "apt.conf.d"),
                                       base.get("APT_CONFIG"), proxy_url=proxy_url, ca_bundle=ca_bundle, files=files)
    return env


def write_files(files: dict) -> None:
    """Write what command_environment put in ``files``, in order (a folder before its files)."""
    for path, text in files.items():
        if text is None:
            os.mkdir(path)
        else:
            _write(path, text)


def _put(target: str, text: str, files: dict) -> str:
    files[target] = text
    return target


def _user_wgetrc(base: dict[str, str], home: str | None) -> str:
    """The wgetrc wget would read after /etc/wgetrc: $WGETRC, else ~/.wgetrc ("" if none)."""
    path = base.get("WGETRC") or (os.path.join(home, ".wgetrc") if home else None)
    if not path:
        return ""
    try:
        return _read(path, errors="replace")
    except OSError:
        return ""


def wgetrc(target: str, user_text: str, *, proxy_url: str, ca_bundle: str | os.PathLike | None, no_proxy: str,
           files: dict) -> str:
    """wget's rc file for the run: the user's own settings, then egress's, which win.

    WGETRC replaces ~/.wgetrc (/etc/wgetrc is still read first), and wget applies the lines in
    order, the last one winning: so a user's `https_proxy` or `ca_certificate` cannot turn wget
    away from egress, while their other settings (user agent, timeouts, ...) still apply.
    """
    lines = [user_text.rstrip("\n"), "", "# egress run: the proxy and the trust bundle (these lines win)"]
    lines += [f"http_proxy = {proxy_url}", f"https_proxy = {proxy_url}", "use_proxy = on", f"no_proxy = {no_proxy}"]
    if ca_bundle:
        lines.append(f"ca_certificate = {ca_bundle}")
    return _put(target, "\n".join(lines).lstrip("\n") + "\n", files)


def apt_config(target: str, empty_dir: str, caller_config: str | None, *, proxy_url: str | None,
               ca_bundle: str | os.PathLike | None, files: dict) -> str:
    """apt's configuration for the run: the system's own, then egress's settings, which win.

    apt reads $APT_CONFIG *first*, then Dir::Etc::parts (/etc/apt/apt.conf.d) and Dir::Etc::main
    (/etc/apt/apt.conf): a proxy named there would override one set here. So this file includes
    them itself, in apt's order, and points those two settings at an empty folder: the system's
    sources, keys and options stay, and egress's lines come last. Measured with apt 2.6.
    """
    files[empty_dir] = None  # a folder
    lines = ["// egress run: the system's apt settings, then the sandbox's own (these win)"]
    if caller_config and _apt_quotable(caller_config) and os.path.isfile(caller_config):
        lines.append(f'#include "{caller_config}";')
    lines.append(f'#include "{APT_PARTS}";')
    if os.path.isfile(APT_MAIN):
        lines.append(f'#include "{APT_MAIN}";')
    lines += [
        f'Dir::Etc::parts "{empty_dir}";',  # read already, above (a missing folder draws a warning)
        f'Dir::Etc::main "{empty_dir}/none";',
        # As root, apt downloads as the user _apt (setegid 65534): in the sandbox's user namespace
        # only the caller's own ids exist, so the http method died ("setegid 65534 failed").
        'APT::Sandbox::User "root";',
        'Acquire::Retries "0";',
    ]
    if proxy_url:
        # A system file may name another proxy, for every host or one (DIRECT), or a script that picks one.
        for key in ("http", "https"):
            lines += [f"#clear Acquire::{key}::Proxy;", f"#clear Acquire::{key}::Proxy-Auto-Detect;",
                      f"#clear Acquire::{key}::ProxyAutoDetect;", f'Acquire::{key}::Proxy "{proxy_url}";']
    if ca_bundle:
        lines.append(f'Acquire::https::CAInfo "{ca_bundle}";')
    return _put(target, "\n".join(lines) + "\n", files)


def _apt_quotable(value: str) -> bool:
    """apt's configuration syntax has no escape for a quote or a line break inside a value."""
    return not any(c in value for c in '"\n\r')


def extended_path(path: str, home: str | None) -> str:
    entries = [p for p in path.split(":") if p]
    for directory in RUNTIME_DIRS:
        if directory.startswith("~"):
            if not home:
                continue
            directory = home + directory[1:]
        if directory not in entries and os.path.isdir(directory):
            entries.append(directory)
    return ":".join(entries)


# What to tell a person whose command is a runtime that is not installed.
INSTALL_HINTS = {
    "node": ("sudo apt-get install nodejs npm", "https://nodejs.org/en/download"),
    "npm": ("sudo apt-get install npm", "https://nodejs.org/en/download"),
    "npx": ("sudo apt-get install npm", "https://nodejs.org/en/download"),
    "python": ("sudo apt-get install python3 python-is-python3", "https://www.python.org/downloads/"),
    "python3": ("sudo apt-get install python3", "https://www.python.org/downloads/"),
    "pip": ("sudo apt-get install python3-pip", "https://pip.pypa.io/en/stable/installation/"),
    "go": ("sudo apt-get install golang", "https://go.dev/dl/"),
    "cargo": ("curl https://sh.rustup.rs -sSf | sh", "https://www.rust-lang.org/tools/install"),
    "rustc": ("curl https://sh.rustup.rs -sSf | sh", "https://www.rust-lang.org/tools/install"),
    "deno": ("curl -fsSL https://deno.land/install.sh | sh", "https://docs.deno.com/runtime/getting_started/installation/"),
    "bun": ("curl -fsSL https://bun.sh/install | bash", "https://bun.sh/docs/installation"),
}


def missing_runtime_hint(program: str, platform: str) -> str | None:
    """A two-line hint for a missing runtime (None for other programs)."""
    hint = INSTALL_HINTS.get(os.path.basename(program))
    if hint is None:
        return None
    command, page = hint
    if platform == "darwin":
        command = f"brew install {'node' if program in ('npm', 'npx') else 'rust' if program in ('cargo', 'rustc') else program}"
    return f"install it with: {command}\nor download it from: {page}"


# Programs that run node code: node itself, the package managers' script runners, and any
# script whose #! line names node (node_modules/.bin/vitest, tsx, ...).
NODE_PROGRAMS = ("node", "nodejs", "npm", "npx", "pnpm", "pnpx", "yarn", "corepack")


def direct_connection_hint(program: str, path: str, cwd: str, proxy_url: str) -> str:
    """What to tell a person whose command failed after trying to connect around the proxy.

    The launcher says it only when the command exited non-zero, the proxy saw no connection
    at all, and the sandbox counted direct attempts (sandbox/netcount.py): all three exact.
    """
    said = (f"egress: {os.path.basename(program)} failed without a single connection through egress's proxy, "
            f"after trying to connect directly (which cannot leave the sandbox)")
    if _runs_node(program, path, cwd):
        return (f"{said}: node's fetch() and http/https follow HTTPS_PROXY only from Node 22.21 and 24.5 on, "
                f"with NODE_USE_ENV_PROXY=1 (egress sets it). Use such a node, or give fetch a proxy-aware "
                f"dispatcher (undici's EnvHttpProxyAgent).")
    return f"{said}: a program that ignores HTTPS_PROXY needs its own proxy setting, {proxy_url}."


def _runs_node(program: str, path: str, cwd: str) -> bool:
    if os.path.basename(program) in NODE_PROGRAMS:
        return True
    import shutil

    found = os.path.join(cwd, program) if "/" in program else shutil.which(program, path=path)
    try:
        with open(found or "", "rb") as f:
            first = f.read(256).split(b"\n", 1)[0]
    except OSError:
        return False
    # "#!/usr/bin/node", "#!/usr/bin/env node", "#!/usr/bin/env -S node --flags"
    return first.startswith(b"#!") and any(os.path.basename(w) in (b"node", b"nodejs") for w in first[2:].split()[:3])
