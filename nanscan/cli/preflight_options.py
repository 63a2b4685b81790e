"""How much a preflight rehearses by default: the values nanscan.preflight runs with and `nanscan preflight --help`
shows, apart from both so that the help reads them without importing torch (NOTE: [fast help] in nanscan/cli/main.py).
"""

DEFAULT_STEPS = 20
DEFAULT_SAMPLE_BATCHES = 16
