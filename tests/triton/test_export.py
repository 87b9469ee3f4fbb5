"""`kvforge export-triton`: the repository's layout, its config against the frontend's contract,
the copied artifact, and the refusals (bad artifact, existing output, bad flags)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.runners.errors import ArtifactError, KvforgeError
from kvforge.runners.manifest import MANIFEST, read_manifest, sha256_file
from kvforge.runners.triton.contract import OUTPUTS, inputs
from kvforge.toolchain.triton import REPOSITORY_MARKER, TritonOptions, default_model_name, export_triton
from tests.triton.frontend import (
    CONFIG_TYPES,
    ENGINE_SAMPLING_INPUTS,
    FRONTEND_INPUTS,
    FRONTEND_OUTPUTS,
    frontend_request,
)


def parse_pbtxt(text: str) -> dict[str, object]:
    """Enough of protobuf's text format for config.pbtxt: the top-level fields and the entries
    of `input`, `output`, `instance_group` and `parameters` (Triton's own parser reads it in
    test_tritonserver.py)."""
    text = re.sub(r"#.*", "", text)
    config: dict[str, object] = {}
    for key in ("name", "backend", "max_batch_size"):
        match = re.search(rf"^{key}: (.+)$", text, re.MULTILINE)
        assert match, key
        config[key] = json.loads(match.group(1))
    config["decoupled"] = re.search(r"model_transaction_policy \{\s*decoupled: true\s*\}", text) is not None
    for section in ("input", "output", "instance_group"):
        match = re.search(rf"^{section} \[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
        assert match, section
        entries = []
        for block in re.findall(r"\{(.*?)\}", match.group(1), re.DOTALL):
            entry: dict[str, object] = {}
            for key, value in re.findall(r"(\w+): (\[[^\]]*\]|\S+)", block):
                entry[key] = json.loads(value) if value.startswith(("[", '"')) or value.isdigit() else value
            entries.append(entry)
        config[section] = entries
    config["parameters"] = dict(re.findall(r'key: "(\w+)"\s*value: \{ string_value: "([^"]*)" \}', text))
    return config


def accepts(dims: list[int], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d in (-1, s) for d, s in zip(dims, shape))


@pytest.fixture(scope="module")
def repository(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "repo"
    export_triton(tiny_artifact, out, TritonOptions(kind="gpu", instances=3, max_num_seqs=5, name="llm"))
    return out


def test_the_repository_holds_one_model_with_the_artifact(repository: Path, tiny_artifact: Path) -> None:
    files = sorted(p.relative_to(repository).as_posix() for p in repository.rglob("*") if p.is_file())
    artifact_files = sorted(p.name for p in tiny_artifact.iterdir())
    assert files == sorted(
        ["README.md", REPOSITORY_MARKER, "llm/config.pbtxt", "llm/1/model.py"]
        + [f"llm/1/artifact/{name}" for name in artifact_files]
    )
    for name in artifact_files:
        assert sha256_file(repository / "llm/1/artifact" / name) == sha256_file(tiny_artifact / name)
    marker = json.loads((repository / REPOSITORY_MARKER).read_text())
    assert marker["model"] == "llm" and marker["kind"] == "gpu" and marker["instances"] == 3
    assert marker["artifact_manifest_sha256"] == sha256_file(tiny_artifact / MANIFEST)


def test_config_declares_exactly_what_the_openai_frontend_sends(repository: Path) -> None:
    config = parse_pbtxt((repository / "llm" / "config.pbtxt").read_text())
    assert (config["name"], config["backend"], config["max_batch_size"]) == ("llm", "python", 0)
    assert config["decoupled"]
    inputs = {entry["name"]: entry for entry in config["input"]}  # type: ignore[attr-defined]
    assert set(inputs) == set(FRONTEND_INPUTS) | ENGINE_SAMPLING_INPUTS
    sent = frontend_request("x", stream=True, max_tokens=1, stop=["a", "b", "c"], guided=("json_schema", "{}"))
    for name, (datatype, values) in sent.items():
        shape = (len(values), len(values[0]))
        assert inputs[name]["data_type"] == CONFIG_TYPES[datatype], name
        assert accepts(inputs[name]["dims"], shape), f"{name}: dims {inputs[name]['dims']} refuse shape {shape}"
    assert [name for name, entry in inputs.items() if entry.get("optional") != "true"] == ["text_input"]
    assert {entry["name"] for entry in config["output"]} == FRONTEND_OUTPUTS  # type: ignore[attr-defined]
    assert config["instance_group"] == [{"count": 3, "kind": "KIND_GPU"}]
    assert config["parameters"] == {
        "max_num_seqs": "5",
        "max_queued": "64",
        "prefill_chunk": "256",
        "prefix_cache_bytes": "auto",
    }


def test_the_contract_table_is_what_the_config_says(repository: Path) -> None:
    config = parse_pbtxt((repository / "llm" / "config.pbtxt").read_text())
    for specs, section in ((inputs(), "input"), (OUTPUTS, "output")):
        written = [(e["name"], e["data_type"], tuple(e["dims"])) for e in config[section]]  # type: ignore[attr-defined]
        assert written == [(s.name, s.data_type, s.dims) for s in specs]


def test_model_py_imports_the_adapter_and_the_readme_has_the_commands(repository: Path) -> None:
    model_py = (repository / "llm" / "1" / "model.py").read_text()
    assert "from kvforge.runners.triton.backend import TritonPythonModel" in model_py
    compile(model_py, "model.py", "exec")
    readme = (repository / "README.md").read_text()
    for command in (
        "tritonserver --model-repository /models",
        "/v2/models/llm/generate_stream",
        "openai_frontend/main.py --model-repository /models",
        "--tokenizer /models/llm/1/artifact",
        '"$(pwd)/repo"',
        "onnxruntime-gpu",  # --kind gpu
    ):
        assert command in readme, command
    # kvforge is on no package index: both install the wheel built from its source tree
    for text in (readme, model_py):
        assert "kvforge==" not in text and "py3-none-any.whl" in text
    assert "json_schema" in readme and "not supported" not in readme  # guided decoding is served


def test_the_same_inputs_give_the_same_bytes(tiny_artifact: Path, tmp_path: Path) -> None:
    outputs = [tmp_path / "a" / "repo", tmp_path / "b" / "repo"]
    for out in outputs:
        export_triton(tiny_artifact, out)
    for path in outputs[0].rglob("*"):
        twin = outputs[1] / path.relative_to(outputs[0])
        assert path.is_dir() or path.read_bytes() == twin.read_bytes(), path


def test_a_modified_artifact_is_refused_and_nothing_is_written(tiny_artifact: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_artifact, broken)
    with open(broken / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(ArtifactError, match=r"tokenizer\.json: sha256 does not match"):
        export_triton(broken, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["broken"]  # no staging directory left either


def test_existing_outputs_and_force(tiny_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "repo"
    export_triton(tiny_artifact, out)
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        export_triton(tiny_artifact, out)
    export_triton(tiny_artifact, out, TritonOptions(force=True, instances=2))
    assert "count: 2" in (out / default_model_name(tiny_artifact) / "config.pbtxt").read_text()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match=f"holds no {REPOSITORY_MARKER}: kvforge did not write it"):
        export_triton(tiny_artifact, other, TritonOptions(force=True))
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(ArtifactError, match="overlaps the artifact"):
        export_triton(tiny_artifact, tiny_artifact / "repo")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (TritonOptions(instances=0), "--instances must be an integer >= 1, got 0"),
        (TritonOptions(kind="tpu"), "--kind 'tpu' is not one of cpu, gpu"),
        (TritonOptions(max_queued=-1), "--max-queued must be an integer >= 0"),
        (TritonOptions(prefix_cache_bytes=-1), "--prefix-cache-bytes must be a byte count >= 0"),
        (TritonOptions(name="a/b"), "--name 'a/b' is not a usable Triton model name"),
        (TritonOptions(name=".hidden"), "--name '.hidden' is not a usable Triton model name"),
    ],
)
def test_bad_options_are_refused(tiny_artifact: Path, tmp_path: Path, options: TritonOptions, message: str) -> None:
    with pytest.raises(KvforgeError, match=re.escape(message)):
        export_triton(tiny_artifact, tmp_path / "repo", options)
    assert not (tmp_path / "repo").exists()


def test_default_model_names(tmp_path: Path) -> None:
    assert default_model_name(tmp_path / "my model (v2)") == "my-model-v2"
    assert default_model_name(tmp_path / "qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert default_model_name(tmp_path / "__") == "kvforge"


def test_cli(tiny_artifact: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "repo"
    result = runner.invoke(main, ["export-triton", str(tiny_artifact), "-o", str(out), "--name", "tiny"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: Triton model 'tiny'" in result.output
    assert read_manifest(out / "tiny" / "1" / "artifact")["files"]
    again = runner.invoke(main, ["export-triton", str(tiny_artifact), "-o", str(out)])
    assert again.exit_code == 2
    assert again.output.strip() == f"kvforge: error: {out}: already exists; pass --force to replace it"
    missing = runner.invoke(main, ["export-triton", str(tmp_path / "nothing"), "-o", str(tmp_path / "r")])
    assert missing.exit_code == 2 and "not an artifact directory" in missing.output
