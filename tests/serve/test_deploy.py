"""deploy/: the gateway's compose file, Kubernetes manifests, Prometheus rules and dashboard,
checked by the tools that will read them, and against what a real `egress serve` exports.

- promtool (Debian's prometheus package) checks the rules and the scrape configurations;
- a real Prometheus on 127.0.0.1 scrapes a real serve with deploy/prometheus's configuration
  and rules: its query API returns egress series, every rule evaluates without error, and
  every dashboard query runs;
- every metric named in the rules and the dashboard is one a real serve's /metrics has;
- kubernetes-validate (PyPI; it ships the Kubernetes JSON schemas, so nothing is fetched)
  checks each manifest strictly, for the oldest and newest Kubernetes it knows;
  `kubectl kustomize` (offline) renders the set where kubectl is installed;
- podman-compose (PyPI, --dry-run: no podman needed) or `docker compose` parses compose.yaml;
- a policy folder laid out as kubelet lays out a ConfigMap, updated as kubelet updates it,
  is followed by a real serve.

Building the image is not tested: no image registry is reachable for a base image, and
making a Python base locally (debootstrap, then pip installing mitmproxy's dependencies)
takes minutes of CI's time.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import DEFAULT_POLICY, proxied_session

yaml = pytest.importorskip("yaml", reason="PyYAML (installed with the test extras) reads the manifests")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
PROMETHEUS = DEPLOY / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
DASHBOARD = PROMETHEUS / "grafana-dashboard.json"


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> list[tuple[str, dict]]:
    """Every resource the kustomization lists, with its file's name."""
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    return [(name, doc) for name in listed for doc in load_all(KUBERNETES / name)]


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def need(tool: str, why: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed ({why})")
    return path


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


# ------------------------------------------------------------ PromQL, as used in deploy/

RULE_EXPRESSIONS = [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append(target["expr"])
    return found


def dashboard_variable_queries() -> list[str]:
    """The template variables' queries (Grafana's label_values(SELECTOR, LABEL))."""
    queries = []
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def as_promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables given values, as Grafana sends it."""
    return expr.replace("$__rate_interval", "1m").replace("$__range", "5m").replace("$instance", ".*")


_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}


def selectors(expr: str) -> list[tuple[str, dict[str, str], set[str]]]:
    """(metric name, {label: matched value}, labels grouped by) for each vector selector in a
    PromQL expression: functions (a name before '('), keywords, numbers and durations are not
    metric names."""
    grouped = {label.strip() for _, labels in _GROUPING.findall(expr) for label in labels.split(",") if label.strip()}
    rest = _GROUPING.sub(" ", expr)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # ranges: [5m], [$__rate_interval]
    found = []
    for match in re.finditer(r"(?<![\w$.\"'])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?(\s*\()?", rest):
        name, matchers, call = match.groups()
        if call or name.lower() in _KEYWORDS:
            continue
        labels = dict(re.findall(r"(\w+)\s*=~?\s*\"([^\"]*)\"", matchers or ""))
        found.append((name, labels, grouped))
    return found


def exported(metrics_text: str) -> tuple[set[str], dict[str, set[str]]]:
    """The series names a /metrics page exports (from its # TYPE lines: a histogram's _bucket,
    _sum and _count) and, per name, the label names its samples carry."""
    names: set[str] = set()
    for kind_line in re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M):
        name, kind = kind_line
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    labels: dict[str, set[str]] = {}
    for name, body in re.findall(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\}", metrics_text, re.M):
        labels.setdefault(name, set()).update(re.findall(r"(\w+)=\"", body))
    return names, labels


def test_the_promql_reader_finds_metric_names_not_functions_or_labels():
    # the reader the name check below relies on, on the shapes deploy/ uses
    assert selectors('sum by (job, instance) (rate(egress_requests_total{job="egress", decision="block"}[5m])) '
                     '> 3 * sum by (job) (rate(egress_requests_total{decision="block"}[1h] offset 5m))') == [
        ("egress_requests_total", {"job": "egress", "decision": "block"}, {"job", "instance"}),
        ("egress_requests_total", {"decision": "block"}, {"job", "instance"})]
    assert [s[0] for s in selectors('histogram_quantile(0.95, sum by (le) (rate(egress_dns_lookup_seconds_bucket'
                                    '{instance=~"$instance"}[$__rate_interval])))')] == ["egress_dns_lookup_seconds_bucket"]
    assert [s[0] for s in selectors('absent(up{job="egress"})')] == ["up"]
    assert [s[0] for s in selectors("up == 0 and on (instance) egress_policy_rules > 1e3")] == ["up", "egress_policy_rules"]


# Labels Prometheus itself attaches (target labels) or that histograms carry.
TARGET_LABELS = {"job", "instance", "pod", "namespace", "le"}


def test_every_metric_in_the_rules_and_the_dashboard_is_one_egress_serve_exports(proxy, http_upstream):
    from egress.core.reasons import REFUSALS, UPSTREAM_ERRORS

    session = proxied_session(proxy)
    assert session.get(http_upstream.url("allowed.test"), timeout=20).status_code == 200
    assert session.get(http_upstream.url("other.test"), timeout=20).status_code == 403
    with socket.socket() as closed:  # a port nothing listens on: an upstream error
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    assert session.get(f"http://allowed.test:{dead}/", timeout=20).status_code == 502
    wait_for(lambda: "egress_upstream_errors_total{" in proxy.metrics(), "the upstream error's count")
    names, labels = exported(proxy.metrics())
    assert "egress_requests_total" in names and "egress_upstream_connect_seconds_bucket" in names

    used = {}
    for expr in RULE_EXPRESSIONS + dashboard_expressions():
        for name, matchers, grouped in selectors(expr):
            used.setdefault(name, []).append((expr, matchers, grouped))
    for query in dashboard_variable_queries():
        selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query).groups()
        for name, matchers, _ in selectors(selector):
            used.setdefault(name, []).append((query, matchers, {label}))
    unknown = sorted(set(used) - names - {"up"})  # up: Prometheus' own, per target
    assert not unknown, f"not exported by egress serve: {unknown}"
    assert len(set(used) - {"up"}) >= 10  # the rules and dashboard cover egress's metrics

    decisions, reasons = {"allow", "block", "error", "mask"}, set(REFUSALS) | set(UPSTREAM_ERRORS) | {"allowed"}
    for name, uses in used.items():
        for expr, matchers, grouped in uses:
            if name in labels:  # the series has samples: its labels are known
                assert set(matchers) - TARGET_LABELS <= labels[name], (name, expr)
            if "decision" in matchers:
                assert set(matchers["decision"].split("|")) <= decisions, expr
            if "reason" in matchers:
                assert set(matchers["reason"].split("|")) <= reasons, expr


# ------------------------------------------------------------------------- promtool


def test_promtool_accepts_the_alert_rules():
    promtool = need("promtool", "Debian's prometheus package; scripts/test installs it")
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULE_EXPRESSIONS)} rules found" in result.stdout
    names = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    # what the issue asks alerts for: down, policy load errors, refusal spikes, upstream errors, credentials
    assert {"EgressDown", "EgressPolicyLoadFailed", "EgressRefusalSpike", "EgressUpstreamErrors",
            "EgressCredentialRefused"} <= names


def test_promtool_accepts_the_scrape_configurations():
    promtool = need("promtool", "Debian's prometheus package; scripts/test installs it")
    single = subprocess.run([promtool, "check", "config", str(PROMETHEUS / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert single.returncode == 0, single.stdout + single.stderr
    assert "SUCCESS: 1 rule files found" in single.stdout  # alerts.yml, found beside it
    cluster = subprocess.run([promtool, "check", "config", str(KUBERNETES / "prometheus-scrape.yml")],
                             capture_output=True, text=True, timeout=60)
    if "field kubernetes_sd_configs not found" in cluster.stdout + cluster.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's is): "
                    "deploy/kubernetes/prometheus-scrape.yml is checked by test_the_kubernetes_scrape_job_"
                    "finds_the_gateways_metrics_port only")
    assert cluster.returncode == 0, cluster.stdout + cluster.stderr


def test_the_kubernetes_scrape_job_finds_the_gateways_metrics_port():
    # The job keeps pods by the Deployment's label and its port's name: both must be the manifests'.
    job, = yaml.safe_load((KUBERNETES / "prometheus-scrape.yml").read_text())["scrape_configs"]
    assert job["job_name"] == "egress"  # the alerts and the dashboard select job="egress"
    keep = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    deployment, = of_kind("Deployment")
    pod = deployment["spec"]["template"]
    assert re.fullmatch(keep[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)],
                        pod["metadata"]["labels"]["app.kubernetes.io/name"])
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert re.fullmatch(keep[("__meta_kubernetes_pod_container_port_name",)], "metrics") and "metrics" in ports
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [deployment["metadata"]["namespace"]]


# ------------------------------------------------------------- a real Prometheus


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_prometheus(binary: str, config: Path, data: Path) -> tuple[subprocess.Popen, str, Path]:
    """A Prometheus on 127.0.0.1 (it takes no port 0: a free port, found by binding one and
    closing it, and another if someone took it meanwhile)."""
    for attempt in range(5):
        port = free_port()
        log = data.parent / f"prometheus-{attempt}.log"
        with open(log, "w") as out:
            process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                                        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if get(f"{url}/-/ready", timeout=2)[0] == 200:
                    return process, url, log
            except OSError:
                pass
            time.sleep(0.1)
        if process.poll() is None:
            process.kill()
        process.wait()
        if "address already in use" not in log.read_text():
            raise AssertionError(f"prometheus did not start:\n{log.read_text()}")
    raise AssertionError("prometheus found no free port in 5 tries")


def query(url: str, promql: str) -> dict:
    status, body = get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    answer = json.loads(body)
    assert status == 200 and answer["status"] == "success", (promql, answer)
    return answer["data"]


def test_a_real_prometheus_scrapes_serve_and_evaluates_every_rule_and_dashboard_query(proxy, http_upstream, tmp_path):
    binary = need("prometheus", "Debian's prometheus package; scripts/test installs it")
    session = proxied_session(proxy)
    assert session.get(http_upstream.url("allowed.test"), timeout=20).status_code == 200
    assert session.get(http_upstream.url("other.test"), timeout=20).status_code == 403
    # deploy/prometheus/prometheus.yml as shipped, pointed at this serve, scraping every second
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS / name) for name in config["rule_files"]]
    job, = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [urllib.parse.urlsplit(proxy.metrics_url).netloc]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    process, url, log = start_prometheus(binary, path, tmp_path / "data")
    try:
        series = wait_for(lambda: (lambda r: r if {s["metric"].get("decision") for s in r} >= {"allow", "block"}
                                   else None)(query(url, 'egress_requests_total{job="egress"}')["result"]),
                          "the scraped egress series")
        assert {s["metric"]["instance"] for s in series} == {urllib.parse.urlsplit(proxy.metrics_url).netloc}
        up, = query(url, 'up{job="egress"}')["result"]
        assert up["value"][1] == "1"
        rules_in_force = re.search(r"^egress_policy_rules (\S+)$", proxy.metrics(), re.M).group(1)
        entries, = query(url, 'max(egress_policy_rules{job="egress"})')["result"]
        assert float(entries["value"][1]) == float(rules_in_force)

        def evaluated():
            _, body = get(f"{url}/api/v1/rules")
            rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
            return rules if len(rules) == len(RULE_EXPRESSIONS) and all(r["health"] != "unknown" for r in rules) else None

        rules = wait_for(evaluated, "every rule's first evaluation")
        assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules] == [
            (r["name"], "ok", "") for r in rules]
        # nothing is wrong with this serve: no alert fires (EgressAbsent, EgressDown: a target is up)
        assert [r["name"] for r in rules if r["state"] == "firing"] == []
        for expr in dashboard_expressions():
            query(url, as_promql(expr))  # parses and evaluates in a real Prometheus
        _, body = get(f"{url}/api/v1/label/instance/values?{urllib.parse.urlencode({'match[]': 'egress_policy_rules'})}")
        assert json.loads(body)["data"] == [urllib.parse.urlsplit(proxy.metrics_url).netloc]  # the $instance list
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_dashboard_is_grafana_json_on_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # every panel fits the 24-column grid and none overlaps another
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


# ------------------------------------------------------------------------ Kubernetes


def test_the_manifests_validate_against_the_kubernetes_schemas():
    validator = pytest.importorskip("kubernetes_validate.utils",
                                    reason="kubernetes-validate (PyPI, installed with the test extras)")
    versions = {validator.all_versions()[0], validator.all_versions()[-1]}  # the oldest and newest it ships
    resources = manifests()
    assert {doc["kind"] for _, doc in resources} >= {"Deployment", "Service", "ConfigMap", "NetworkPolicy",
                                                       "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    for version in versions:
        for name, doc in resources:
            validator.validate(doc, version, strict=True)  # raises on any unknown or mistyped field
    # the validator is strict for real: a misspelled field is caught
    deployment = json.loads(json.dumps(of_kind("Deployment")[0]))
    deployment["spec"]["replica"] = 3
    with pytest.raises(validator.ValidationError, match="'replica' was unexpected"):
        validator.validate(deployment, max(versions), strict=True)


def test_every_manifest_file_is_in_the_kustomization_and_kubectl_renders_it():
    listed = set(yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"])
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == files  # prometheus-scrape.yml is Prometheus' configuration, not a manifest
    kubectl = need("kubectl", "kubectl kustomize renders the set offline")
    rendered = subprocess.run([kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert len(docs) == len(manifests())
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"egress"}


def test_the_gateway_deployment_is_hardened_probed_and_scaled():
    deployment, = of_kind("Deployment")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    container, = pod["containers"]
    args = container["args"]
    option = lambda name: args[args.index(name) + 1]  # noqa: E731
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert spec["replicas"] >= 2
    assert int(option("--listen").rsplit(":", 1)[1]) == ports["proxy"]
    assert int(option("--metrics").rsplit(":", 1)[1]) == ports["metrics"]
    probes = {kind: (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
              for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": ("/healthz", "metrics"), "livenessProbe": ("/healthz", "metrics"),
                      "readinessProbe": ("/readyz", "metrics")}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    # the policy: the ConfigMap mounted as a folder (a subPath mount is never updated by kubelet)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    policy_mount, = [m for m in container["volumeMounts"] if "configMap" in volumes[m["name"]]]
    assert "subPath" not in policy_mount and Path(option("--policy")).parent == Path(policy_mount["mountPath"])
    configmap, = of_kind("ConfigMap")
    assert volumes[policy_mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
    assert Path(option("--policy")).name in configmap["data"]
    # every writable place a read-only root leaves egress: its state folder and /tmp (--workers)
    state = next(e["value"] for e in container["env"] if e["name"] == "EGRESS_STATE_DIR")
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert {state, "/tmp"} <= writable
    # one CA for every replica, from a Secret, where egress looks for it
    ca = [m for m in container["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert [m["mountPath"] for m in ca] == [f"{state}/ca"] and not volumes[ca[0]["name"]]["secret"].get("optional")
    assert mounts  # (named mounts are unique)
    # the objects that point at the gateway's pods select them
    labels = spec["template"]["metadata"]["labels"]
    service, = of_kind("Service")
    pdb, = of_kind("PodDisruptionBudget")
    hpa, = of_kind("HorizontalPodAutoscaler")
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"],
                     spec["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_shipped_policies_load(tmp_path):
    from egress.policy import settings

    configmap, = of_kind("ConfigMap")
    for name, text in configmap["data"].items():
        (tmp_path / name).write_text(text)
    assert settings.load([str(tmp_path / "policy.toml")]).policy.rule_count > 0
    assert settings.load([str(DEPLOY / "policy" / "policy.toml")]).policy.rule_count > 0


def allowed_by(rule_blocks: list[dict], address: str) -> bool:
    """Whether a NetworkPolicy's ipBlock peers let ``address`` through (inside a cidr, outside its excepts)."""
    ip = ipaddress.ip_address(address)
    for peer in rule_blocks:
        block = peer.get("ipBlock")
        if block is None:
            continue
        cidr = ipaddress.ip_network(block["cidr"])
        if ip.version == cidr.version and ip in cidr and not any(
                ip in ipaddress.ip_network(e) for e in block.get("except", [])):
            return True
    return False


# (address, what it is, may the gateway reach it)
GATEWAY_DESTINATIONS = [
    ("10.244.1.17", "a pod (flannel/kubeadm's pod range)", False),
    ("10.96.0.1", "the kubernetes API's service address (kubeadm)", False),
    ("10.0.12.5", "a node in a 10/8 VPC", False),
    ("172.20.0.10", "an EKS service address", False),
    ("192.168.49.2", "a minikube node", False),
    ("100.64.3.4", "a CGNAT-range pod (some CNIs)", False),
    ("169.254.169.254", "cloud metadata (AWS, GCP, Azure)", False),
    ("169.254.170.2", "ECS task metadata", False),
    ("127.0.0.1", "loopback", False),
    ("::1", "IPv6 loopback", False),
    ("fd00:ec2::254", "AWS metadata over IPv6", False),
    ("fd12:3456::1", "an IPv6 cluster's pod (unique local)", False),
    ("fe80::1", "IPv6 link-local", False),
    ("::ffff:10.0.0.1", "a private IPv4 address written in IPv6", False),
    ("64:ff9b::a9fe:a9fe", "metadata through NAT64", False),
    ("151.101.0.223", "pypi.org (public)", True),
    ("140.82.112.3", "github.com (public)", True),
    ("2a04:4e42::223", "pypi.org over IPv6 (public)", True),
]


@pytest.mark.parametrize("address,what,reachable", GATEWAY_DESTINATIONS, ids=[d[1] for d in GATEWAY_DESTINATIONS])
def test_the_gateway_may_reach_the_internet_but_not_the_cluster_nodes_or_metadata(address, what, reachable):
    gateway = next(p for p in of_kind("NetworkPolicy") if p["metadata"]["name"] == "egress-gateway")
    assert "Egress" in gateway["spec"]["policyTypes"]
    peers = [peer for rule in gateway["spec"]["egress"] for peer in rule["to"]]
    assert allowed_by(peers, address) is reachable, what


def test_app_pods_may_reach_only_the_gateway_and_dns():
    deployment, = of_kind("Deployment")
    gateway_labels = deployment["spec"]["template"]["metadata"]["labels"]
    proxy_port = next(p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
                      if p["name"] == "proxy")
    apps = next(p for p in of_kind("NetworkPolicy") if p["metadata"]["name"] != "egress-gateway")
    assert apps["spec"]["policyTypes"] == ["Egress"]
    destinations = []
    for rule in apps["spec"]["egress"]:
        for peer in rule["to"]:
            assert "ipBlock" not in peer  # no address range: pods chosen by label only
            destinations.append((peer["podSelector"]["matchLabels"], sorted((p["protocol"], p["port"]) for p in rule["ports"])))
    assert destinations == [(gateway_labels, [("TCP", proxy_port)]),
                            ({"k8s-app": "kube-dns"}, [("TCP", 53), ("UDP", 53)])]
    # and the gateway admits exactly those pods on the proxy port
    gateway = next(p for p in of_kind("NetworkPolicy") if p["metadata"]["name"] == "egress-gateway")
    admitted = gateway["spec"]["ingress"][0]
    assert admitted["from"][0]["podSelector"]["matchLabels"] == apps["spec"]["podSelector"]["matchLabels"]
    assert admitted["ports"] == [{"protocol": "TCP", "port": proxy_port}]


# --------------------------------------------------------------------------- compose


def compose_config() -> dict:
    """compose.yaml as a compose implementation reads it: podman-compose (--dry-run: no podman
    needed) or `docker compose config`."""
    podman_compose = shutil.which("podman-compose") or (
        str(Path(os.sys.executable).parent / "podman-compose")
        if (Path(os.sys.executable).parent / "podman-compose").exists() else None)
    if podman_compose:
        command = [podman_compose, "--dry-run", "-f", str(DEPLOY / "compose.yaml"), "config"]
    elif shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        command = ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "config"]
    else:
        pytest.skip("neither podman-compose (PyPI, in the test extras) nor docker compose is installed")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=DEPLOY)
    assert result.returncode == 0, result.stdout + result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_puts_the_app_on_a_network_whose_only_exit_is_the_gateway():
    config = compose_config()
    gateway, app = config["services"]["egress"], config["services"]["app"]
    networks = config["networks"]
    app_networks = list(app["networks"])
    assert app_networks and all(networks[name].get("internal") is True for name in app_networks)
    assert set(app_networks) <= set(gateway["networks"])
    assert any(not networks[name].get("internal") for name in gateway["networks"])  # the gateway's road out
    args = gateway["command"]
    option = lambda name: args[args.index(name) + 1]  # noqa: E731
    proxy_port = option("--listen").rsplit(":", 1)[1]
    for variable in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        assert app["environment"][variable] == f"http://egress:{proxy_port}"
    # the policy folder, read-only, where --policy looks; the metrics port published
    mounts = [str(v) for v in gateway["volumes"]]
    assert any(m.endswith(f":{Path(option('--policy')).parent}:ro") for m in mounts), mounts
    assert any(str(p).endswith(f":{option('--metrics').rsplit(':', 1)[1]}") for p in gateway["ports"])
    assert gateway["read_only"] is True and gateway["cap_drop"] == ["ALL"]
    assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    assert app["depends_on"]["egress"]["condition"] == "service_healthy"


# --------------------------------------------------- a ConfigMap, as kubelet writes it


class KubeletVolume:
    """A ConfigMap volume laid out and updated as kubelet's AtomicWriter does it: each version
    of the data in a new ``..<timestamp>`` folder, ``..data`` a symlink to the current one,
    each key a symlink ``KEY -> ..data/KEY``; an update writes the new folder, points a new
    ``..data_tmp`` at it, renames that over ``..data`` (the atomic step), adds links for new
    keys, removes those of keys gone, and deletes the old folder."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(mode=0o755)
        self.versions = 0

    def write(self, data: dict[str, str | bytes]) -> None:
        self.versions += 1
        stamp = self.root / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{os.getpid()}{self.versions:04d}"
        stamp.mkdir(mode=0o755)
        for key, text in data.items():
            (stamp / key).write_bytes(text if isinstance(text, bytes) else text.encode())
            (stamp / key).chmod(0o644)
        current = self.root / "..data"
        old = os.readlink(current) if current.is_symlink() else None
        os.symlink(stamp.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", current)
        for key in data:
            if not (self.root / key).is_symlink():
                os.symlink(f"..data/{key}", self.root / key)
        for link in self.root.iterdir():
            if not link.name.startswith("..") and link.name not in data:
                link.unlink()
        if old is not None:
            shutil.rmtree(self.root / old)


def test_a_configmap_update_written_as_kubelet_writes_it_reaches_serve_each_time(proxy_factory, http_upstream, tmp_path):
    # The policy includes a second key of the same ConfigMap: an update of that key alone must
    # reload too, and every later update (the folder of the one before deleted each time).
    from test_live_policy import status

    volume = KubeletVolume(tmp_path / "configmap")
    policy = DEFAULT_POLICY.replace('allow = ["allowed.test"', 'include = ["team.toml"]\nallow = ["allowed.test"')
    team = 'allow = ["other.test"]\nallow_private = ["other.test"]\n'
    volume.write({"policy.toml": policy, "team.toml": "allow = []\n"})
    proxy = proxy_factory(DEFAULT_POLICY, "--policy", str(volume.root / "policy.toml"))
    url = http_upstream.url("other.test")

    def reloads() -> int:
        return sum("policy reloaded" in line for line in proxy.stderr_lines)

    assert status(proxy, url) == 403
    volume.write({"policy.toml": policy, "team.toml": team})  # only the included key changed
    wait_for(lambda: reloads() >= 1, "the reload after the first update")
    assert status(proxy, url) == 200
    volume.write({"policy.toml": policy, "team.toml": "allow = []\n"})
    wait_for(lambda: reloads() >= 2, "the reload after the second update")
    assert status(proxy, url) == 403
    volume.write({"policy.toml": 'allow = ["com"]\n'})  # a broken update, team.toml's key gone
    wait_for(lambda: any("policy not reloaded" in line for line in proxy.stderr_lines), "the refused update")
    assert status(proxy, http_upstream.url("allowed.test")) == 200  # the last good policy
    assert re.search(r"^egress_policy_load_errors_total 1\.0$", proxy.metrics(), re.M)
    volume.write({"policy.toml": policy, "team.toml": team})  # fixed
    wait_for(lambda: reloads() >= 3, "the reload after the fix")
    assert status(proxy, url) == 200
    assert sorted(p.name for p in volume.root.iterdir() if not p.name.startswith("..")) == ["policy.toml", "team.toml"]
    assert len([p for p in volume.root.iterdir() if p.name.startswith("..") and p.name != "..data"]) == 1


def test_replicas_share_a_ca_given_read_only_as_a_secret_volume(tmp_path, https_upstream, test_ca_file, monkeypatch):
    # deploy/kubernetes mounts the egress-ca Secret read-only at $EGRESS_STATE_DIR/ca: serve must
    # use that CA and write nothing there. Made as the README says (egress ca path), laid out as
    # kubelet lays out a Secret, and mounted read-only (a bind mount in a mount namespace).
    import sys

    import conftest

    need("unshare", "util-linux: a mount namespace for the read-only mount")
    made = tmp_path / "gateway-ca"
    subprocess.run([*conftest.egress_command(), "ca", "path", "--state-dir", str(made)], check=True,
                   capture_output=True, env=conftest.clean_env(tmp_path))
    secret = KubeletVolume(tmp_path / "secret")
    secret.write({p.name: p.read_bytes() for p in (made / "ca").iterdir() if p.is_file()})  # --from-file=gateway-ca/ca/
    where = tmp_path / "replica"
    (where / "state" / "ca").mkdir(parents=True)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}")
    mount = 'mount --bind -o ro "$0" "$1" && shift && exec "$@"'
    monkeypatch.setattr(conftest, "egress_command", lambda: [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(secret.root),
        str(where / "state" / "ca"), sys.executable, "-m", "egress.cli"])
    proxy = conftest.start_proxy(where, DEFAULT_POLICY, upstream_ca=test_ca_file)
    try:
        session = proxied_session(proxy)
        session.verify = str(made / "ca" / "mitmproxy-ca-cert.pem")  # what the apps were given
        assert session.get(https_upstream.url("allowed.test"), timeout=20).status_code == 200
        assert get(proxy.metrics_url.replace("/metrics", "/readyz"))[0] == 200
    finally:
        conftest.stop_proxy(proxy)
    assert not any("Traceback" in line for line in proxy.stderr_lines), "".join(proxy.stderr_lines)
