#!/bin/sh
# A fake inference server whose first $3 starts crash with the saved log $1 (exit 1), then one
# that serves: it prints vLLM's throughput line and stays up. $2 counts the starts across runs.
count=$(( $(cat "$2" 2>/dev/null || echo 0) + 1 ))
echo "$count" > "$2"
if [ "$count" -le "$3" ]; then
  exec /opt/vsup/e2e/fake-server.sh "$1" 1
fi
echo "(APIServer pid=$$) INFO 11-30 11:00:00 [api_server.py:1839] vLLM API server version 0.11.0"
echo "(APIServer pid=$$) INFO 11-30 11:00:30 [loggers.py:123] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s"
exec sleep infinity
