"""The look the pages share: the verdict line each page opens with (run, sweep and conform pages)."""

# ``<p class="verdict pass|fail|error">`` with one ``<span class="arm pass|fail|error|none">`` per arm
# (or release): pass green, fail red, could not evaluate purple, a bar on the left in the overall colour
VERDICT_CSS = """
p.verdict{font-size:15px;margin:.5em 0 .6em;padding:.45em .8em;border:1px solid #ddd;border-left:6px solid #999;
background:#fafafa;line-height:1.5}
p.verdict.pass{border-left-color:#2e7d32;background:#f1f8f1}
p.verdict.fail{border-left-color:#c62828;background:#fdf1f1}
p.verdict.error{border-left-color:#6a1b9a;background:#f7f0fa}
.verdict .arm{font-weight:600}
.verdict .arm.pass{color:#1b5e20}.verdict .arm.fail{color:#b71c1c}.verdict .arm.error{color:#6a1b9a}
.verdict .arm.none{color:#666}
.verdict .role{font-weight:normal}
"""
