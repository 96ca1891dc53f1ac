"""The launcher: runs a command where the egress proxy is the only road out."""
