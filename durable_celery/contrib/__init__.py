"""Integrations with other frameworks, each behind its extra (``[django]``)."""
