"""`egress serve`: one proxy, or N workers on one port."""
