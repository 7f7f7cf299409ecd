from agent.capture.explain import explain_destination
from agent.capture.policy import CapturePolicy

POLICY = CapturePolicy(True, 15001, 18081, 0xAE, 0xFF, ((5432, 5432),), ("10.0.0.0/8",),
                       ("fd00::/8",))


def test_every_branch() -> None:
    e = explain_destination
    assert e(POLICY, ["10.1.1.1"], "10.1.1.1", 80).startswith("direct: the pod's own")
    assert "always excluded" in e(POLICY, [], "169.254.169.254", 80)
    assert "always excluded" in e(POLICY, [], "::1", 80)
    assert "exclude-outbound-ip-ranges" in e(POLICY, [], "10.2.3.4", 80)
    assert "exclude-outbound-ip-ranges" in e(POLICY, [], "fd00::5", 80)
    assert "exclude-outbound-ports" in e(POLICY, [], "192.0.2.1", 5432)
    assert "passes it through" in e(POLICY, [], "192.0.2.1", 443)
    assert "Service app/echo" in e(POLICY, [], "192.0.2.9", 80, {("192.0.2.9", 80): "app/echo"})
    scoped = CapturePolicy(False, 15001, 18081, 0xAE, 0xFF)
    assert "scoped mode" in e(scoped, [], "192.0.2.1", 443)
    assert "redirected" in e(scoped, [], "192.0.2.1", 18081)
    assert "not an IP" in e(POLICY, [], "echo", 80)
