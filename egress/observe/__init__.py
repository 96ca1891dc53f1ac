"""Observation: every decision as an event, Prometheus metrics, and the lines a person reads."""
