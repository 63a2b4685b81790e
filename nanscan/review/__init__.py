"""Reading a run's evidence after the fact: report (a bundle's diagnosis in the terminal or as HTML), triage (many
bundles ranked and grouped), export (a bundle's history as CSV or TensorBoard event files); each with its
subcommand. Importing this package imports nothing: its modules are taken by name.
"""
