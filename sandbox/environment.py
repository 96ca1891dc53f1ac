"""The environment a sandboxed command gets.

Every proxy and CA variable real clients read is *set*, never inherited: this
machine (like many CI images) exports its own ``SSL_CERT_FILE``,
``REQUESTS_CA_BUNDLE``, ``PIP_CERT``... which would otherwise win. Which client
reads which spelling is recorded in shared/research/real-clients.md: curl ignores
upper-case ``HTTP_PROXY``, wget ignores upper-case names, so both are set.
"""

from __future__ import annotations

import os
from pathlib import Path

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy",
                   "npm_config_proxy", "npm_config_https_proxy", "CARGO_HTTP_PROXY", "PIP_PROXY",
                   "YARN_HTTP_PROXY", "YARN_HTTPS_PROXY")
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO",
                "CARGO_HTTP_CAINFO", "npm_config_cafile", "NODE_EXTRA_CA_CERTS", "DENO_CERT",
                "AWS_CA_BUNDLE", "HTTPLIB2_CA_CERTS", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
                "NIX_SSL_CERT_FILE", "CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE", "YARN_CA_FILE_PATH")
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
}

# Runtimes commonly live here; added to PATH when they exist.
RUNTIME_DIRS = ("/opt/homebrew/bin", "/usr/local/bin", "~/.nvm/current/bin", "~/.local/share/fnm/aliases/default/bin",
                "~/.volta/bin", "~/.local/share/mise/shims", "~/.asdf/shims", "~/.pyenv/shims", "~/.rbenv/shims",
                "~/.cargo/bin", "~/go/bin", "~/.bun/bin", "~/.deno/bin", "~/.local/bin")

def trust_bundle(roots: list[str], egress_ca: Path, target: Path) -> Path:
    """Write one bundle: the roots egress trusts upstream (egress.trust: the system's CAs and
    --upstream-ca; passthrough hosts are verified by the command itself) and egress's CA."""
    parts = [Path(path).read_text(encoding="utf-8", errors="replace") for path in roots]
    parts.append(egress_ca.read_text(encoding="utf-8"))
    target.write_text("\n".join(parts), encoding="utf-8")
    return target


def command_environment(base: dict[str, str], *, proxy_url: str | None, ca_bundle: Path | None,
                        tmpdir: Path, home: str | None = None) -> dict[str, str]:
    """The command's environment: ``base`` with every proxy, CA and cache variable decided here."""
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
    if ca_bundle:
        for name in CA_VARIABLES:
            env[name] = str(ca_bundle)

    env.update(FAIL_FAST)
    caches = tmpdir / "cache"
    env.update({
        "TMPDIR": str(tmpdir), "TMP": str(tmpdir), "TEMP": str(tmpdir),
        "PIP_CACHE_DIR": str(caches / "pip"), "npm_config_cache": str(caches / "npm"),
        "YARN_CACHE_FOLDER": str(caches / "yarn"), "XDG_CACHE_HOME": str(caches),
        "GOCACHE": str(caches / "go-build"), "GOMODCACHE": str(caches / "go-mod"),
    })
    env["PATH"] = extended_path(base.get("PATH", "/usr/local/bin:/usr/bin:/bin"), home or base.get("HOME"))
    return env


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
