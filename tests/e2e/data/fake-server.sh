#!/bin/sh
# A fake inference server: prints a saved crash log as the server printed it (without the
# journal's "Mon DD HH:MM:SS host ident[pid]: " prefix) and exits with status $2 (default 1).
sed -E 's/^[A-Z][a-z]{2} [ 0-9]{2} [0-9:]{8} [^ ]+ [^ ]+\[[0-9]+\]: //' "$1"
exit "${2:-1}"
