"""Structured outputs: a grammar's spec, its compilation (in a child process, bounded in time
and memory: xgrammar or llguidance, chosen per schema), the matcher window over a verify
window, and a worker's book of them per slot."""
