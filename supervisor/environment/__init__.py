"""The served environment: interpreter probes, snapshots and their drift, ExecStart,
the serving line, who holds a port."""
