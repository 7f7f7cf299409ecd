"""The XMesh supportedFeatures claim is exactly the features the conformance suite shows:
every claimed feature names tests that exist in integration/test_gamma_conformance.py (which
CI runs on the real Envoy), and nothing is claimed besides them."""

from __future__ import annotations

import ast
from pathlib import Path

from agent.gamma.xmesh import FEATURE_TESTS, SUPPORTED_FEATURES, desired_status

SUITE = Path(__file__).resolve().parent.parent / "integration" / "test_gamma_conformance.py"


def _suite_tests() -> set[str]:
    tree = ast.parse(SUITE.read_text())
    return {n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_claimed_feature_names_tests_that_exist() -> None:
    tests = _suite_tests()
    for feature, names in FEATURE_TESTS.items():
        assert names, f"{feature} is claimed with no test"
        missing = [n for n in names if n not in tests]
        assert not missing, f"{feature} names tests the suite does not have: {missing}"


def test_the_claim_is_generated_from_the_map() -> None:
    assert tuple(sorted(FEATURE_TESTS)) == SUPPORTED_FEATURES
    st = desired_status({}, "aether.io/mesh", "node-a", SUPPORTED_FEATURES)
    assert [f["name"] for f in st["supportedFeatures"]] == sorted(FEATURE_TESTS)
