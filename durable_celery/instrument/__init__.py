"""What wraps a start and every step attempt to watch it: spans (tracing), log capture (logs),
and the hooks the core calls (``hooks.Instrumentation``)."""
