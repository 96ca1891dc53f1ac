"""The domain policy.

- egress.policy.matcher: a loaded policy and its decisions. Pure: no files, sockets or DNS.
- egress.policy.loader: TOML files, includes, built-in sets, every problem with file:line.
- egress.policy.text: a policy file's TOML text and the line of every entry.
- egress.policy.settings: the credential settings written beside the policy.

Import from the module that defines a name: this package's face re-exports nothing, so
reading a Decision never costs the loader's imports (tomllib, difflib).
"""
