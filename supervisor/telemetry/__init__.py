"""The daemon's own signals: Prometheus metrics, the /metrics and /healthz endpoint, logging."""
