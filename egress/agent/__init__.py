"""Guardrails for agent harnesses: the command deny list, fences, output caps, the write guard."""
