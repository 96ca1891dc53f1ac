"""`python -m egress`: the `egress` command (egress.entry)."""

from egress.entry import main

main()
