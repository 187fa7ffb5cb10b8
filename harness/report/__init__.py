"""Reporting: a run loaded once (``summary``), its tables and HTML page (``tables``), plots
(``plots``, cached by ``plotcache``), and the sim beside a real run (``fidelity``). Pure over the
records; imported lazily by the commands that print or write them (pandas, matplotlib)."""
