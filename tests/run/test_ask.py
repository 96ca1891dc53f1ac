"""egress.run.ask's askers are what the proxy asks of one (egress.proxy.seams.Asker): checked with
isinstance on a runtime-checkable Protocol of the same members, so a member the proxy comes to
read, or one an asker loses, fails here and not on a held request."""

from __future__ import annotations

import asyncio
import inspect
from typing import Protocol, runtime_checkable

import pytest

from egress.host.control import RunState
from egress.proxy.seams import Asker
from egress.run.ask import NeverAsk, TerminalAsker


@runtime_checkable
class CheckedAsker(Asker, Protocol):
    """egress.proxy.seams.Asker, checkable at run time (the same members)."""


def askers(state: RunState) -> list:
    return [TerminalAsker(state, "true", tty="/nonexistent/tty"), NeverAsk(state, say=lambda line: None)]


@pytest.mark.parametrize("index", [0, 1], ids=["TerminalAsker", "NeverAsk"])
def test_each_asker_is_an_asker_as_the_proxy_names_it(index):
    state = RunState("run1", ["true"])
    asker = askers(state)[index]
    assert isinstance(asker, CheckedAsker)
    assert inspect.iscoroutinefunction(asker.ask)
    assert asker.state is state and "example.test" not in asker.state.grants


@pytest.mark.parametrize("index", [0, 1], ids=["TerminalAsker", "NeverAsk"])
def test_a_host_granted_is_allowed_without_a_question_and_none_else_is_by_default(index):
    state = RunState("run1", ["true"])
    asker = askers(state)[index]
    state.grant("granted.test")
    assert asyncio.run(asker.ask("granted.test")) is True
    # no terminal to ask on (a tty that cannot be opened) or headless: kept blocked
    assert asyncio.run(asker.ask("other.test")) is False
