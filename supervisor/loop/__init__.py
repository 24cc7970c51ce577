"""The live loop's parts, composed by `app.compose_daemon` into `daemon.Daemon`.

`replay` (entries read again after a restart), `checkpoint` (decisions and what was done about
them, committed with their cursor), `acting` (a unit's lane: enrich, act, record as taken),
`settle` (ended runs decided once their late lines are read), `gates` (a gate's answer),
`reload` (SIGHUP).
"""
