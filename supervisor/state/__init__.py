"""The state database's one owner: the writer thread, the read connection and the tables of
the store itself (supervisor.store composes them)."""
