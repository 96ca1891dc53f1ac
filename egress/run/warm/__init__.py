"""The warm proxy: one server per user and installation, forking one child per run."""
