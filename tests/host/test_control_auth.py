"""The control socket answers only processes outside egress sandboxes.

A sandboxed command runs as the same user as egress, so the socket's 0600 does not
stop it; the server checks that each peer lives in its own user namespace. Clients
here are real processes: this interpreter as is, and this interpreter in a user
namespace of its own (`unshare --user --map-root-user`), as every `egress run`
command is. The end-to-end case (a real `egress run` trying to grant itself) is in
test_grants.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from egress.host.control import (
    REFUSED,
    ControlServer,
    RunState,
    peer_pidfd,
    peercred_pidfd,
    pidfd_user_namespace,
    request,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="peers are identified through Linux pidfds and /proc")

# Connects, sends one request line, prints every byte answered until the server closes.
CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
try:
    sock.sendall(sys.argv[2].encode() + b"\\n")
except (BrokenPipeError, ConnectionResetError):  # refused and closed before we wrote: read the answer
    pass
answer = b""
try:
    while chunk := sock.recv(65536):
        answer += chunk
except ConnectionResetError:  # the server closed with our request unread
    pass
sys.stdout.write(answer.decode())
"""

SAME_NAMESPACE: list[str] = []
NEW_USER_NAMESPACE = ["unshare", "--user", "--map-root-user"]


@pytest.fixture(scope="module")
def unshare():
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([*NEW_USER_NAMESPACE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a user namespace here: {probe.stderr.strip()}")


@pytest.fixture
def server(tmp_path):
    state = RunState("authtest", ["sh"])
    control = ControlServer(state, tmp_path / "state")
    yield control
    control.close()


def client(prefix: list[str], path, payload: dict) -> list[dict]:
    result = subprocess.run([*prefix, sys.executable, "-c", CLIENT, str(path), json.dumps(payload)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_a_client_in_our_namespace_can_read_and_grant(server):
    assert [a["run"] for a in client(SAME_NAMESPACE, server.path, {"op": "info"})] == ["authtest"]
    assert client(SAME_NAMESPACE, server.path, {"op": "allow", "host": "ok.test"}) == [{"ok": True, "host": "ok.test"}]
    assert server.state.grants == {"ok.test"}
    assert list(request(server.path, {"op": "info"}))[0]["grants"] == ["ok.test"]  # egress's own client too


@pytest.mark.parametrize("payload", [
    {"op": "allow", "host": "evil.test"},
    {"op": "info"},
    {"op": "events"},
    {"op": "reload"},
], ids=lambda payload: payload["op"])
def test_a_client_in_another_user_namespace_is_refused_before_its_request_is_read(server, unshare, payload):
    answers = client(NEW_USER_NAMESPACE, server.path, payload)
    # One error line, then the server closed (an events stream it followed would never end).
    assert answers == [{"error": REFUSED}]
    assert "outside egress sandboxes" in REFUSED
    assert server.state.grants == set()


def test_egress_own_client_reports_the_refusal(server, unshare):
    code = ("import json, sys; from pathlib import Path; from egress.host.control import request; "
            "print(json.dumps(list(request(Path(sys.argv[1]), {'op': 'allow', 'host': 'evil.test'}))))")
    result = subprocess.run([*NEW_USER_NAMESPACE, sys.executable, "-c", code, str(server.path)],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"error": REFUSED}]
    assert server.state.grants == set()


# Both ways of finding the peer (SO_PEERPIDFD, and SO_PEERCRED for kernels before 6.5), for
# a peer in our namespace and one in a user namespace of its own.
@pytest.mark.parametrize("find", [peer_pidfd, peercred_pidfd], ids=["SO_PEERPIDFD", "SO_PEERCRED"])
@pytest.mark.parametrize("prefix, ours", [(SAME_NAMESPACE, True), (NEW_USER_NAMESPACE, False)],
                         ids=["same namespace", "new user namespace"])
def test_each_way_of_finding_the_peer_sees_its_namespace(tmp_path, unshare, find, prefix, ours):
    path = tmp_path / "peer.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        peer = subprocess.Popen([*prefix, sys.executable, "-c", CLIENT, str(path), "{}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        conn, _ = listener.accept()
        with conn:
            pidfd = find(conn)
            try:
                namespace = pidfd_user_namespace(pidfd)
            finally:
                os.close(pidfd)
        peer.wait(60)
    mine = os.stat("/proc/self/ns/user")
    assert (namespace == (mine.st_dev, mine.st_ino)) is ours


def test_a_peer_that_is_gone_is_refused(server):
    # The client connects, sends, and exits (and is reaped) before anyone looks at it.
    sock_path = os.path.join(os.path.dirname(server.path), "gone.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(sock_path))
        listener.listen(1)
        code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
                "s.sendall(b'{\"op\": \"allow\", \"host\": \"evil.test\"}\\n'); import os; os._exit(0)")
        subprocess.run([sys.executable, "-c", code, str(sock_path)], check=True, timeout=60)
        conn, _ = listener.accept()
        with conn:
            assert not server.peer_allowed(conn)


def test_a_peer_of_our_own_process_is_allowed(server):
    left, right = socket.socketpair()
    with left, right:
        assert server.peer_allowed(left)
