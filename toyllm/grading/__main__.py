from .cli import _cli

raise SystemExit(_cli())
