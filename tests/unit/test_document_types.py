"""The TypedDicts that name the daemon's documents hold the keys their builders write, in order,
so the types and the bytes on the wire cannot drift apart."""

from __future__ import annotations

from coordinator.nodes.session import NodeView, NodeViewDict
from coordinator.observe.alerts.payloads import AlertDocument, alert_document
from coordinator.observe.alerts.rules import Alert
from coordinator.readiness import checks
from coordinator.readiness.calibration import CALIBRATION_KEY_FIELDS, calibration_key
from coordinator.readiness.push import SyncPlan, SyncPlanDict
from coordinator.readiness.sync import ScanStats
from coordinator.relay.broadcast import Outcome, OutcomeDict
from coordinator.store.state import CalibrationKey
from shared.manifest import ScanStats as ManifestScanStats


def test_each_document_type_lists_the_keys_its_builder_writes_in_order():
    assert list(NodeViewDict.__annotations__) == list(NodeView("a", "local", "up").as_dict())
    assert list(SyncPlanDict.__annotations__) == list(SyncPlan().as_dict())
    assert list(OutcomeDict.__annotations__) == list(Outcome("a").as_dict())
    assert list(ScanStats.__annotations__) == list(ManifestScanStats().as_dict())
    assert list(AlertDocument.__annotations__) == list(alert_document(Alert("job_failed", "t", "m", "c", 0.0)))
    assert list(checks.CheckResult.__annotations__) == list(checks.check("x", "health", checks.PASS, "ok"))


def test_the_calibration_key_holds_the_key_fields_in_their_order():
    assert tuple(CalibrationKey.__annotations__) == CALIBRATION_KEY_FIELDS
    assert tuple(calibration_key({})) == CALIBRATION_KEY_FIELDS
    assert calibration_key({"chip": "M2", "gpu": "metal", "other": 1}) == {
        "chip": "M2", "os_version": None, "os_build": None, "mlx_version": None, "python_executable": None,
        "gpu": "metal"}
