"""Values other programs rely on, defined once: exit statuses and network modes.

The README documents both; the CLI, the policy loader, the launcher and the
sandbox take them from here (a bare 125 elsewhere is a bug: tests/core/test_contract.py).
No imports: sandbox/linux.py reads this on the path of every `egress run`.
"""

# ------------------------------------------------------------ exit statuses

# egress's own commands (serve, check, policy validate, ca, doctor, ...)
EXIT_OK = 0
EXIT_REFUSED = 1  # check: a target refused; policy validate: a problem; doctor: run cannot confine
EXIT_USAGE = 2  # click's usage errors
EXIT_POLICY = 3  # the policy (or its credential settings) cannot be loaded; nothing started
EXIT_LISTEN = 4  # cannot listen: the proxy or metrics address is in use or not permitted
EXIT_STATE = 5  # the state directory, the CA, --upstream-ca or the audit log is unusable
EXIT_WORKERS = 6  # serve --workers: a worker could not be started or kept running; every worker stopped

# `egress run`: otherwise the command's own status (shell conventions, as env and docker run)
EXIT_TIMEOUT = 124  # --timeout expired; everything the command started was killed
EXIT_LAUNCHER = 125  # egress run itself failed before the command started (policy, folder, sandbox)
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

# ------------------------------------------------------------ network modes

# The `network` key of a policy file and `egress run --network`, in the order they are offered.
NETWORK_MODES = ("allowlist", "all", "off")
DEFAULT_NETWORK = "allowlist"

# ------------------------------------------------------------ where egress run's proxy lives

# `egress run --proxy` and its default from the environment (egress.run.warm.client; README). Here, not in
# egress.run.warm.client: the launcher reads them first thing, before the sandbox starts (bench/README.md,
# "Launch without pathlib and json").
PROXY_MODES = ("warm", "lazy")
PROXY_MODE_ENV = "EGRESS_PROXY"

# The user name in the proxy URL `egress run` gives a command whose proxy asks for a secret
# (macOS, `serve --auth`): http://egress:SECRET@127.0.0.1:PORT (egress.proxy.auth).
PROXY_USER = "egress"
