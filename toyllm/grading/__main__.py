from .grader.cli import cli_main

raise SystemExit(cli_main())
