"""`egress run`: the launcher, the run's proxy (warm or lazy), the person in the loop, doctor."""
