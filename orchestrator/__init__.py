"""The orchestrator: the client-facing service that runs the speculative loop."""
