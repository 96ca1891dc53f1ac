"""Every hook of every addon in egress/proxy/addons carries the guard wrapper (an AST walk, as
tests/core/test_contract.py walks exit statuses).

mitmproxy logs what a hook raises as an "Addon error" and goes on as if the hook had not been
there: a hook without egress.proxy.failclosed.guard fails open, and a Refused it raises is
never carried out. Only the lifecycle hooks (load, configure, running, done, update) see no
traffic and may go without.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mitmproxy.addonmanager  # noqa: F401 -- each module registers its hooks on import
import mitmproxy.dns  # noqa: F401
import mitmproxy.http  # noqa: F401
import mitmproxy.proxy.layers.http  # noqa: F401
import mitmproxy.proxy.server_hooks  # noqa: F401
import mitmproxy.tcp  # noqa: F401
import mitmproxy.tls  # noqa: F401
import mitmproxy.udp  # noqa: F401
import mitmproxy.websocket  # noqa: F401
from mitmproxy import hooks

ROOT = Path(__file__).resolve().parents[2]
ADDONS = sorted((ROOT / "egress" / "proxy" / "addons").rglob("*.py"))
LIFECYCLE = {"load", "configure", "running", "done", "update"}
TRAFFIC_HOOKS = set(hooks.all_hooks) - LIFECYCLE
WRAPPER = "guard"


def _decorated(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(getattr(d, "id", getattr(d, "attr", None)) == WRAPPER for d in function.decorator_list)


def _hooks(path: Path):
    """(class, hook, wrapped) for each traffic hook of each addon class in ``path``: its methods
    named as a hook, and class attributes so named (``request = _answer``: wrapped if the
    method they name is)."""
    tree = ast.parse(path.read_text())
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef) or cls.bases:  # addons are plain classes; layers subclass mitmproxy's
            continue
        methods = {f.name: f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for name, function in methods.items():
            if name in TRAFFIC_HOOKS:
                yield cls.name, name, _decorated(function)
        for node in cls.body:
            if isinstance(node, ast.Assign):
                named = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id in TRAFFIC_HOOKS]
                method = methods.get(getattr(node.value, "id", None))
                for name in named:
                    yield cls.name, name, method is not None and _decorated(method)


FOUND = [(path.relative_to(ROOT).as_posix(), *hook) for path in ADDONS for hook in _hooks(path)]


def test_every_hook_of_every_addon_carries_the_guard_wrapper():
    bare = [f"{path}: {cls}.{hook}" for path, cls, hook, wrapped in FOUND if not wrapped]
    assert not bare, "hooks that would fail open: decorate them with @guard (egress.proxy.failclosed)"


def test_the_walk_sees_the_addons_the_proxy_is_built_with():
    # so that the test above cannot pass by finding nothing
    classes = {cls for _, cls, _, _ in FOUND}
    assert {"PolicyGuard", "CredentialGuard", "AddressGuard", "UpstreamErrors", "Reporter", "Passthrough",
            "ProtocolGuard", "Limits", "InjectionLabel", "UpstreamTimeout", "LineFirst"} <= classes
    assert ("egress/proxy/addons/line_first.py", "LineFirst", "requestheaders", True) in FOUND
    assert {"http_connect", "requestheaders", "next_layer", "server_connect", "websocket_message"} <= TRAFFIC_HOOKS
