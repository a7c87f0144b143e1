"""The `aigw` command line (entry point `cli.main:main`): the top layer, importing the parts it
drives (gateway, engine, auth, bench) inside each subcommand's handler, so `aigw --help` and the
gateway's subcommands never load the engine."""
