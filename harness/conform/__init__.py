"""``omni-stress conform``: the phase contract's schedule invariance, checked per stage model.

Layout: ``adapter`` (the interface one model implements), ``models/`` (one small adapter per
model: its upstream file and hook, a CPU stand-in, its payload), ``schedules`` (the forced
schedules), ``driver`` (feeds a schedule's spans through the sim's runner semantics, or runs
vLLM's scheduler under a deploy), ``compare`` (the oracle and the cells), ``check`` (one model's
matrix row), ``report`` (terminal, JSON, HTML). ``vendor/`` holds the vLLM-Omni 0.30.0 files
read when no other source of that version is there.
"""
