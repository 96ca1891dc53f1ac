"""The platform layer: the sandboxes `egress run` holds a command in (Linux namespaces with
Landlock and seccomp, hardened podman and docker containers, macOS Seatbelt, and --provider local,
which is none), behind one interface (sandbox/api.py; platforms.py and providers.py choose one).
It imports nothing of egress but egress.core; the launcher that uses it is egress/run/launcher.py.
"""
