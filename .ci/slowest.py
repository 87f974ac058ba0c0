"""Print a pytest run's wall time and its ten slowest tests (setup + call + teardown) from its JUnit XML.

Usage: python .ci/slowest.py JUNIT_XML MAKE_TEST_SECONDS
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(junit_xml: str, make_s: float) -> None:
    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    pytest_s = sum(float(s.get("time", 0.0)) for s in suites)
    tests = sum(int(s.get("tests", 0)) for s in suites)
    cases = sorted(((float(c.get("time") or 0.0), f"{c.get('classname')}::{c.get('name')}")
                    for c in root.iter("testcase")), reverse=True)
    print(f"\ntest suite: {tests} tests in {pytest_s:.0f} s of pytest wall time ({pytest_s / 60:.1f} min); "
          f"make test {make_s:.0f} s in all (install and ruff included)")
    print("the ten slowest tests (setup + call + teardown):")
    for seconds, name in cases[:10]:
        print(f"  {seconds:7.1f} s  {name}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
