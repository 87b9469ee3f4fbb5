"""examples/ci/github-actions.yml: a workflow that builds, verifies and uploads the artifact."""

from __future__ import annotations

from typing import Any

import pytest

from tests.examples.conftest import EXAMPLES

yaml = pytest.importorskip("yaml")

WORKFLOW = EXAMPLES / "ci" / "github-actions.yml"


@pytest.fixture(scope="module")
def workflow() -> dict[Any, Any]:
    data = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(data, dict)
    return data


def steps(workflow: dict[Any, Any]) -> list[dict[str, Any]]:
    (job,) = workflow["jobs"].values()
    return list(job["steps"])


def test_is_a_workflow(workflow: dict[Any, Any]) -> None:
    assert workflow["name"]
    assert True in workflow or "on" in workflow  # YAML 1.1 reads the key `on` as True
    (job,) = workflow["jobs"].values()
    assert job["runs-on"]
    assert all("uses" in s or "run" in s for s in job["steps"])


def test_builds_verifies_then_uploads_the_directory(workflow: dict[Any, Any]) -> None:
    env = workflow["env"]
    assert env["ARTIFACT"] and env["CHECKPOINT"]
    runs = {i: s["run"] for i, s in enumerate(steps(workflow)) if "run" in s}

    def step_running(text: str) -> int:
        return next(i for i, run in runs.items() if text in run)

    install, build, verify = (step_running(t) for t in ("pip install", "kvforge build", "kvforge verify"))
    assert install < build < verify
    assert '-o "$ARTIFACT"' in runs[build]
    assert '--checkpoint "$CHECKPOINT"' in runs[verify]

    uploads = [i for i, s in enumerate(steps(workflow)) if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert len(uploads) == 1 and uploads[0] > verify
    upload = steps(workflow)[uploads[0]]["with"]
    # the whole artifact directory, so manifest.json goes with the files it lists
    assert upload["path"] == "${{ env.ARTIFACT }}"
    assert upload["if-no-files-found"] == "error"
