"""Telling people about crashes: whether and how (`decision`), the durable queue (`queue`), the
delivery loop with pacing and retries (`outbox`), the Slack message (`message`) and webhook
(`webhook`)."""
