"""Acting on decisions: the only place that stops, restarts or quarantines a unit.

`presence` judges whether an ended invocation is the present one (pure); `halt` quarantines and
stops a unit; `actor` carries out a decision after asking systemd, with dry-run honoured here
and nowhere else.
"""
