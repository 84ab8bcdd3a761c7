"""The CLI's tools around a run, one subcommand a module: each has `add_parser(sub)` and `run(args)`."""
