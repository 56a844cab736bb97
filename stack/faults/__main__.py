"""``python -m stack.faults``: the scenarios and their table (stack.faults.cli)."""

from stack.faults.cli import main

raise SystemExit(main())
