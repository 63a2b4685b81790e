"""Thin adapters between nanscan and other frameworks, one module per framework; each imports its framework only
inside itself, so `import nanscan` never needs (or pays for) any of them."""
