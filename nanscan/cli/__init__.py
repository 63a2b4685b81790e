"""The `nanscan` command line, in one place: main (the program, its subcommand table and `nanscan info`; NOTE:
[fast help]), errors (what every subcommand shares: the console, one-line errors, exit statuses, JSON output, the
entry options), and the subcommands of the single-module tools (demo, preflight, bench) with the options each
shares with its tool (bench_options, preflight_options).

A package's own subcommands stay beside the code they drive (nanscan.replay.cli, nanscan.data.cli,
nanscan.bundle.cli, and report, triage, export and ablate in theirs); main names them all. Importing this package
imports nothing: every help must answer without torch.
"""
