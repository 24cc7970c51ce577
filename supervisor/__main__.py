"""`python -m vllm_supervisor` runs the command line."""

from .cli import main

raise SystemExit(main())
