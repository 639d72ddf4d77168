"""The alert rules (``dashboards/rules.yaml``) pass ``promtool check rules`` and their promtool unit tests
(``dashboards/rules_test.yaml``: every alert fires on unhealthy series and stays quiet on healthy ones), and every
metric their expressions use is documented in ``docs/metrics.md``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "rules.yaml"
DOC = ROOT / "docs" / "metrics.md"
METRIC = re.compile(r"vattn:[a-z0-9_:]+")
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian: apt-get install prometheus)")


def promtool(*args: str) -> None:
    # Run from dashboards/: rules_test.yaml names rules.yaml relative to itself.
    run = subprocess.run([PROMTOOL, *args], cwd=DASHBOARDS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"promtool {' '.join(args)} failed:\n{run.stdout}{run.stderr}"


@needs_promtool
def test_rules_are_valid():
    promtool("check", "rules", RULES.name)


@needs_promtool
def test_alerts_fire_and_stay_quiet_as_the_unit_tests_expect():
    promtool("test", "rules", "rules_test.yaml")


def test_rules_use_only_documented_metrics():
    documented = set(re.findall(r"^\| `(vattn:[a-z0-9_:]+)` \|", DOC.read_text(), re.M))
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    used = {m for r in rules for m in METRIC.findall(r["expr"])}
    # A histogram's series carry a suffix the docs leave off; a documented name (iteration_tokens_total) stays whole.
    names = {m if m in documented else re.sub(r"_(bucket|count|sum)$", "", m) for m in used}
    assert names, "no vattn: metric found in the rules' expressions"
    assert names <= documented, f"not in docs/metrics.md: {sorted(names - documented)}"
