"""egress.proxy.ca.StateDir: one value for the state folder, read by everything that keeps state there."""

from __future__ import annotations

import pytest

from egress.host.control import run_socket
from egress.proxy.ca import StateDir, ca_cert_path
from egress.proxy.config import ProxyConfig
from egress.run.warm.client import Paths


def test_its_folders_and_where_each_user_of_the_state_finds_them(tmp_path):
    state = StateDir.of(tmp_path)
    assert (state.ca, state.runs, state.warm) == (f"{tmp_path}/ca", f"{tmp_path}/runs", f"{tmp_path}/warm")
    assert ca_cert_path(tmp_path) == state.ca_cert == f"{tmp_path}/ca/mitmproxy-ca-cert.pem"
    assert run_socket(str(tmp_path), "run1") == f"{tmp_path}/runs/run1.sock"
    assert Paths.for_state(tmp_path).folder == state.warm
    assert ProxyConfig(state_dir=tmp_path).state == state and StateDir.of(state) is state


def test_none_is_the_default_read_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRESS_STATE_DIR", str(tmp_path / "env"))
    assert StateDir.of(None) == StateDir.of("") == StateDir(str(tmp_path / "env")) == ProxyConfig().state
    monkeypatch.delenv("EGRESS_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert StateDir.of(None).root == str(tmp_path / "xdg" / "egress")


def test_it_does_not_change(tmp_path):
    with pytest.raises(AttributeError):
        StateDir.of(tmp_path).root = "/elsewhere"
