"""The gate's verdict as JUnit XML for CI: one testcase per rule x cell."""

from __future__ import annotations

import xml.etree.ElementTree as ET


from harness.gate.evaluate import GateResult

def junit_xml(result: GateResult, suite: str = "omni-stress gate") -> str:
    """JUnit XML: one testcase per rule x cell; failures and errors carry the check messages."""
    tests = len(result.cases) + len(result.problems)
    failures = result.count("fail")
    errors = result.count("error") + len(result.problems)
    name = f"{suite}: {result.run_id}" if result.run_id else suite
    root = ET.Element("testsuites", name=suite, tests=str(tests), failures=str(failures), errors=str(errors))
    ts = ET.SubElement(root, "testsuite", name=name, tests=str(tests), failures=str(failures), errors=str(errors),
                       skipped=str(result.count("skip")), time="0")
    for case in result.cases:
        tc = ET.SubElement(ts, "testcase", classname=f"omni-stress.gate.{case.rule.name}",
                           name=f"{case.rule.name}: {case.cell_label}", time="0")
        if case.status in ("fail", "error"):
            tag = "failure" if case.status == "fail" else "error"
            el = ET.SubElement(tc, tag, message=case.message, type=f"gate.{tag}")
            el.text = case.message
        elif case.status == "skip":
            ET.SubElement(tc, "skipped", message=case.message)
        out = ET.SubElement(tc, "system-out")
        out.text = "\n".join(f"{c.status}: {c.message}" for c in case.checks)
    for i, problem in enumerate(result.problems):
        tc = ET.SubElement(ts, "testcase", classname="omni-stress.gate", name=f"could not evaluate ({i + 1})",
                           time="0")
        el = ET.SubElement(tc, "error", message=problem, type="gate.error")
        el.text = problem
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def junit_error_xml(message: str, suite: str = "omni-stress gate") -> str:
    """A JUnit file for a gate that could not start (bad rules, missing run), so CI shows why."""
    return junit_xml(GateResult(cases=[], problems=[message]), suite)
