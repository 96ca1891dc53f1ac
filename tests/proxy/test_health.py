"""/healthz and /readyz on the metrics port: what a Kubernetes probe or a load balancer asks.

/healthz: the process answers. /readyz: 200 once the policy is in force and the proxy listens,
503 with the reason otherwise: before the proxy listens, while it stops, and under
`--workers N` while any worker is not serving (starting, or being replaced after it died).
Real serves and a real builder in this process, probed over HTTP as kubelet does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import urllib.error
import urllib.request

import pytest
from conftest import DEFAULT_POLICY, proxied_session
from test_workers import children, wait_for

from egress.policy import settings
from egress.proxy.build import ProxyBuilder
from egress.proxy.config import ProxyConfig

linux_only = pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="--workers needs Linux (SO_REUSEPORT)")


def probe(metrics_url: str, path: str) -> tuple[int, str]:
    url = metrics_url.rsplit("/", 1)[0] + path
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_serving_proxy_is_alive_and_ready_and_still_serves_metrics(proxy, http_upstream):
    assert probe(proxy.metrics_url, "/healthz") == (200, "ok\n")
    assert probe(proxy.metrics_url, "/readyz") == (200, "ready\n")
    assert proxied_session(proxy).get(http_upstream.url("allowed.test"), timeout=20).status_code == 200
    assert 'egress_requests_total{decision="allow",reason="allowed"} 1.0' in proxy.metrics()


def test_a_broken_policy_edit_keeps_the_proxy_ready_with_its_last_good_policy(proxy_factory, http_upstream):
    # The proxy keeps serving the last good policy: taking every replica out of service because
    # of one bad ConfigMap edit would turn a typo into an outage. The edit is counted instead
    # (egress_policy_load_errors_total, which deploy/prometheus alerts on).
    proxy = proxy_factory()
    (proxy.audit_path.parent / "policy.toml").write_text('allow = ["com"]\n')
    wait_for(lambda: any("policy not reloaded" in line for line in proxy.stderr_lines), "the refused reload")
    assert probe(proxy.metrics_url, "/readyz") == (200, "ready\n")
    assert "egress_policy_load_errors_total 1.0" in proxy.metrics()


def test_readyz_says_not_ready_until_the_proxy_listens_and_once_it_stops(tmp_path):
    builder = ProxyBuilder(ProxyConfig(listen=("127.0.0.1", 0), metrics=("127.0.0.1", 0), state_dir=tmp_path / "state"))
    builder.serve_metrics()
    answers = {"before": probe(builder.metrics_url, "/readyz"), "alive": probe(builder.metrics_url, "/healthz")}

    async def main():
        proxy = await builder.start(settings.from_mapping({"allow": ["a.test"]}).policy)
        answers["serving"] = await asyncio.to_thread(probe, builder.metrics_url, "/readyz")
        proxy.stop()
        answers["stopping"] = await asyncio.to_thread(probe, builder.metrics_url, "/readyz")
        await proxy.run_until_stopped()

    try:
        asyncio.run(main())
    finally:
        builder.close()
    assert answers == {"before": (503, "not ready: the proxy is not listening yet\n"), "alive": (200, "ok\n"),
                       "serving": (200, "ready\n"),
                       "stopping": (503, "not ready: the proxy is stopping (draining its connections)\n")}


@linux_only
def test_with_workers_ready_means_every_worker_serves(proxy_factory):
    proxy = proxy_factory(DEFAULT_POLICY, "--workers", "2")
    workers = wait_for(lambda: (lambda c: c if len(c) == 2 else None)(children(proxy.process.pid)), "two workers")
    assert probe(proxy.metrics_url, "/readyz") == (200, "ready\n")
    seen: list[tuple[int, str]] = []
    replaced = threading.Event()

    def watch():  # every answer until the replacement serves (its start takes ~1 s of imports)
        while not replaced.is_set():
            seen.append(probe(proxy.metrics_url, "/readyz"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        os.kill(workers[0], signal.SIGKILL)
        wait_for(lambda: any("serving again" in line for line in proxy.stderr_lines), "the replacement")
    finally:
        replaced.set()
        watcher.join()
    # which worker number the killed pid had is the supervisor's business: either one's line
    assert {answer for answer in seen if answer[0] == 503} & {
        (503, f"not ready: worker {n} of 2 is not serving yet (starting or being replaced)\n") for n in (1, 2)}
    assert probe(proxy.metrics_url, "/readyz") == (200, "ready\n")
    assert probe(proxy.metrics_url, "/healthz") == (200, "ok\n")
    with socket.create_connection(("127.0.0.1", proxy.port)):
        pass  # still listening
