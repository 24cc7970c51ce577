"""Telling people about crashes, through sinks (`sink`: the contract; `fanout`: all of them as
one notifier). Whether and how a crash is told (`decision`); edge-triggered sinks' durable queue
(`queue`) and delivery loop with pacing and retries (`outbox`); level-triggered sinks' loop
(`level`). Each module that defines `build_sink(config)` is a sink: Slack (`slack`, its message
`message`, webhook `webhook` and reload `webhook_reload`) and Alertmanager (`alertmanager`).

The commands (`supervisor/commands/`) use nothing of this stage: its `__all__` is empty
(tests/test_import_graph.py checks it).
"""

__all__: list[str] = []
