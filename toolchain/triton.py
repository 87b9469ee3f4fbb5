"""`kvforge export-triton`: a Triton Inference Server model repository that runs an artifact.

The repository holds one decoupled (streaming) Python-backend model whose `1/model.py` hands
Triton kvforge's own engine (`kvforge.runners.triton.backend`): continuous batching, sampling,
UTF-8-safe streaming and stop strings, on the artifact copied into `1/artifact/`. Its
`config.pbtxt` declares the tensors Triton's OpenAI frontend sends to models that are not
vLLM's (`kvforge.runners.triton.contract`), so that frontend, Triton's `generate` endpoints and gRPC
streaming clients all work.

The artifact is checked against its manifest before it is copied, and the copy again after;
the repository is staged beside the output and swapped into place as builds are
(`kvforge.toolchain.publish`), with `kvforge-triton.json` written last as the mark that kvforge wrote
it (what `--force` may replace).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvforge.runners.errors import ArtifactError, KvforgeError
from kvforge.runners.manifest import MANIFEST, read_manifest, verify_files
from kvforge.runners.settings import serving_settings
from kvforge.runners.triton.contract import (
    ARTIFACT_DIR,
    AUTO_BUDGET,
    ENGINE_PARAMETERS,
    OUTPUTS,
    PREFIX_CACHE_PARAMETER,
    TensorSpec,
    inputs,
)
from kvforge.toolchain.publish import check_output, publish, staged

log = logging.getLogger(__name__)

REPOSITORY_MARKER = "kvforge-triton.json"
REPOSITORY_FORMAT = 1
VERSION = "1"  # the model's version directory
KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MAX_NAME = 128


@dataclass(frozen=True)
class TritonOptions:
    kind: str = "cpu"
    instances: int = 1
    name: str | None = None
    force: bool = False
    max_num_seqs: int = ENGINE_PARAMETERS["max_num_seqs"]
    max_queued: int = ENGINE_PARAMETERS["max_queued"]
    prefill_chunk: int = ENGINE_PARAMETERS["prefill_chunk"]
    prefix_cache_bytes: int | None = None  # None: a quarter of the memory available at load; 0: off

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise KvforgeError(f"--kind {self.kind!r} is not one of {', '.join(KINDS)}; choose one")
        engine = [
            (s.flag, getattr(self, s.name), int(s.minimum or 0)) for s in serving_settings() if s.triton_parameter
        ]
        for flag, value, least in [("--instances", self.instances, 1), *engine]:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise KvforgeError(f"{flag} must be an integer >= {least}, got {value!r}")
        budget = self.prefix_cache_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise KvforgeError(f"--prefix-cache-bytes must be a byte count >= 0 (0: off), got {budget!r}")
        if self.name is not None:
            check_model_name(self.name, "--name")


@dataclass(frozen=True)
class TritonRepository:
    path: Path
    model: str
    files: int  # artifact files copied (manifest included)


def check_model_name(name: str, where: str) -> None:
    if not _NAME.fullmatch(name) or len(name) > _MAX_NAME:
        raise KvforgeError(
            f"{where} {name!r} is not a usable Triton model name: use up to {_MAX_NAME} letters, digits, '_', '.' "
            "or '-', starting with a letter or digit (it names a directory and appears in URLs)"
        )


def default_model_name(artifact: Path) -> str:
    """The artifact directory's name, with what a model name cannot hold replaced by '-'."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", artifact.resolve().name).strip("_.-")[:_MAX_NAME]
    return name or "kvforge"


def export_triton(artifact: Path, output: Path, options: TritonOptions = TritonOptions()) -> TritonRepository:
    """Write a Triton model repository serving ARTIFACT to `output`; returns what was written."""
    options.validate()
    artifact, output = Path(artifact), Path(output)
    manifest = read_manifest(artifact)
    verify_files(artifact, manifest)
    name = options.name or default_model_name(artifact)
    check_model_name(name, f"model name (from {artifact.resolve().name!r}; pass --name)")
    _check_apart(artifact, output)
    check_output(output, options.force, marker=REPOSITORY_MARKER)
    files = [*sorted(manifest["files"]), MANIFEST]
    with staged(output, marker=REPOSITORY_MARKER) as staging:
        model = staging / name
        copy = model / VERSION / ARTIFACT_DIR
        copy.mkdir(parents=True)
        for file in files:
            shutil.copyfile(artifact / file, copy / file)
        verify_files(copy, read_manifest(copy))  # the copy is what Triton will load
        (model / "config.pbtxt").write_text(render_config(name, options))
        (model / VERSION / "model.py").write_text(render_model_py(kvforge_version()))
        (staging / "README.md").write_text(render_readme(name, output.name, options, kvforge_version()))
        marker = {
            "format": REPOSITORY_FORMAT,
            "kvforge": kvforge_version(),
            "model": name,
            "kind": options.kind,
            "instances": options.instances,
            "artifact_manifest_sha256": hashlib.sha256((artifact / MANIFEST).read_bytes()).hexdigest(),
        }
        (staging / REPOSITORY_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        publish(staging, output, marker=REPOSITORY_MARKER, force=options.force)
    log.info("wrote %s: model %r, %d artifact files", output, name, len(files))
    return TritonRepository(output, name, len(files))


def _check_apart(artifact: Path, output: Path) -> None:
    source, target = artifact.resolve(), output.resolve()
    if target == source or source in target.parents or target in source.parents:
        raise ArtifactError(
            f"{output}: overlaps the artifact {artifact}; choose an -o outside it (and not containing it)"
        )


def kvforge_version() -> str:
    try:
        return metadata.version("kvforge")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


# -- what the repository holds --------------------------------------------------------------


def render_config(name: str, options: TritonOptions) -> str:
    """config.pbtxt: the Python backend, decoupled, no batch dimension, the frontend's tensors."""
    lines = [
        "# Written by `kvforge export-triton`: kvforge's engine on the artifact in 1/artifact/.",
        "# The inputs are those Triton's OpenAI frontend sends to a model that is not vLLM's.",
        f'name: "{name}"',
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy {",
        "  decoupled: true",
        "}",
        _tensors("input", inputs()),
        _tensors("output", OUTPUTS),
        "instance_group [",
        "  {",
        f"    count: {options.instances}",
        f"    kind: {KINDS[options.kind]}",
        "  }",
        "]",
    ]
    for key in ENGINE_PARAMETERS:
        lines += ["parameters {", f'  key: "{key}"', f'  value: {{ string_value: "{getattr(options, key)}" }}', "}"]
    budget = AUTO_BUDGET if options.prefix_cache_bytes is None else str(options.prefix_cache_bytes)
    lines += ["parameters {", f'  key: "{PREFIX_CACHE_PARAMETER}"', f'  value: {{ string_value: "{budget}" }}', "}"]
    return "\n".join(lines) + "\n"


def _tensors(section: str, specs: tuple[TensorSpec, ...]) -> str:
    blocks = []
    for spec in specs:
        body = [
            f'    name: "{spec.name}"',
            f"    data_type: {spec.data_type}",
            f"    dims: [ {', '.join(map(str, spec.dims))} ]",
        ]
        if spec.optional:
            body.append("    optional: true")
        blocks.append("  {\n" + "\n".join(body) + "\n  }")
    return f"{section} [\n" + ",\n".join(blocks) + "\n]"


_MODEL_PY = '''"""Triton Python-backend model: kvforge's engine serving the artifact in ./artifact.

Written by `kvforge export-triton` (kvforge @VERSION@). The work is done by kvforge's runtime
package, which the Python backend's environment must hold: see the repository's README.md.
"""

try:
    from kvforge.runners.triton.backend import TritonPythonModel
except ImportError as error:
    raise ImportError(
        f"kvforge's runtime package is not importable in Triton's Python backend environment ({error}); "
        "install it there without torch: pip install --no-deps kvforge-@VERSION@-py3-none-any.whl (the wheel "
        "`pip wheel --no-deps -w dist .` makes in kvforge's source tree), then "
        "pip install onnxruntime tokenizers jinja2 llguidance (see the repository's README.md)"
    ) from error

__all__ = ["TritonPythonModel"]
'''


def render_model_py(version: str) -> str:
    return _MODEL_PY.replace("@VERSION@", version)


def render_readme(name: str, repository: str, options: TritonOptions, version: str) -> str:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    ort = "onnxruntime-gpu" if options.kind == "gpu" else "onnxruntime"
    return _README.format(
        name=name,
        repo=repository,
        version=version,
        kind=KINDS[options.kind],
        instances=options.instances,
        python=python,
        ort=ort,
        max_num_seqs=options.max_num_seqs,
        max_queued=options.max_queued,
        prefill_chunk=options.prefill_chunk,
        prefix_cache=(
            "a quarter of the memory available when the instance loads"
            if options.prefix_cache_bytes is None
            else f"{options.prefix_cache_bytes} bytes"
            if options.prefix_cache_bytes
            else "off"
        ),
    )


_README = """# Triton model repository: `{name}`

Written by `kvforge export-triton` (kvforge {version}). One model, `{name}`: Triton's Python
backend running kvforge's engine (continuous batching, sampling, UTF-8-safe streaming, stop
strings) on the kvforge artifact in `{name}/1/artifact/`, checked against its manifest when
each instance starts.

```
{name}/config.pbtxt     backend "python", decoupled (streaming), {instances} x {kind}
{name}/1/model.py       hands Triton kvforge's kvforge.runners.triton.backend.TritonPythonModel
{name}/1/artifact/      the artifact (model.onnx, tokenizer, manifest.json, ...)
kvforge-triton.json     what wrote this repository (`kvforge export-triton --force` replaces it)
```

Inputs (each `[1, 1]`, `stop_words` `[1, n]`): `text_input` (string, required), `stream`
(bool), `max_tokens` (int32), `stop_words` (strings), `temperature`, `top_p`, `min_p`,
`repetition_penalty` (fp32), `top_k` (int32), `frequency_penalty`, `presence_penalty` (fp32,
only 0 is accepted), `seed` (uint64),
`return_num_input_tokens`, `return_num_output_tokens` (bool), `guided_decoding_guide_type`,
`guided_decoding_guide` (strings: guided decoding with guide type `json`, `json_schema` or
`regex`, as TensorRT-LLM's backend takes them; other guide types are refused). Outputs: `text_output`,
`num_input_tokens`, `num_output_tokens` (int32). With `stream` true each response carries the
new text and `num_output_tokens` the tokens since the previous response; otherwise one
response carries everything. A request Triton cancels (its client went away) is aborted in
the engine and answered with a CANCELLED error.

Engine parameters (edit `parameters` in config.pbtxt, or export again):
`max_num_seqs` {max_num_seqs} (requests generating at once per instance), `max_queued`
{max_queued} (waiting per instance; beyond, requests fail with UNAVAILABLE), `prefill_chunk`
{prefill_chunk} (prompt tokens per engine step), `prefix_cache_bytes`: {prefix_cache} (the KV
of prompt prefixes reused across requests, in blocks of 16 tokens, least recently used evicted;
a byte count such as 268435456 or 256M, 0 for off, `auto` for a quarter of the memory available).
Each instance is a process with its own copy of the weights, its own KV cache and its own prefix
cache.

## The Python backend's environment

Triton's Python backend runs `model.py` in its stub process, `triton_python_backend_stub`,
which embeds the Python it was built for (Triton's containers: their own Python; this
repository was written under Python {python}) and imports packages from the first `python3`
on `PATH`. That environment needs:

```
pip wheel --no-deps -w dist /path/to/kvforge          # in kvforge's source tree: its wheel
pip install --no-deps dist/kvforge-{version}-py3-none-any.whl
pip install {ort} tokenizers jinja2 llguidance
```

and numpy in the version the Python backend of your Triton release accepts (`numpy<2` for
Triton 2.51). kvforge is not on a package index: install the wheel built from the source tree
this repository was exported with (`pip install --no-deps /path/to/kvforge` does the same
without a wheel file). `--no-deps` keeps pip from replacing `{ort}` or numpy; torch is not
needed at run time. llguidance serves guided decoding.

## Serve it with tritonserver

In NGC's Triton container, with the environment above added to it:

```
cat > Dockerfile <<'EOF'
FROM nvcr.io/nvidia/tritonserver:24.10-py3
COPY kvforge-{version}-py3-none-any.whl /tmp/
RUN pip install --no-deps /tmp/kvforge-{version}-py3-none-any.whl && \\
    pip install {ort} tokenizers jinja2 llguidance "numpy<2"
EOF
docker build -t kvforge-triton .
docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 -v "$(pwd)/{repo}:/models" kvforge-triton \\
    tritonserver --model-repository /models
```

Then stream over HTTP (server-sent events) or gRPC (`ModelStreamInfer`):

```
curl -s localhost:8000/v2/health/ready -o /dev/null -w '%{{http_code}}\\n'    # 200 when loaded
curl -N -X POST localhost:8000/v2/models/{name}/generate_stream \\
    -d '{{"text_input": "def fibonacci(n):", "max_tokens": 64, "temperature": 0, "stream": true}}'
curl -s localhost:8002/metrics | grep -E 'nv_inference_request_success|kvforge_'
```

Without a container or a GPU (`--kind cpu`), the `tritonserver` bundled with the PyPI
package `nvidia-pytriton` 0.7.0 (Triton 2.51, Python backend only) serves it:

```
python3 -m venv .venv-triton
.venv-triton/bin/pip install nvidia-pytriton==0.7.0 "numpy<2" onnxruntime tokenizers jinja2 llguidance
.venv-triton/bin/pip install --no-deps /path/to/kvforge    # its source tree, or the wheel built from it
SP=$(.venv-triton/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PY=$(.venv-triton/bin/python -c 'import sys; print(f"{{sys.version_info[0]}}.{{sys.version_info[1]}}")')
LIBPYTHON=$(.venv-triton/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
mkdir -p triton-backends/python
cp "$SP"/pytriton/tritonserver/backends/python/libtriton_python.so \\
   "$SP"/pytriton/tritonserver/backends/python/triton_python_backend_utils.py triton-backends/python/
cp "$SP/pytriton/tritonserver/python_backend_stubs/$PY/triton_python_backend_stub" triton-backends/python/
LD_LIBRARY_PATH="$SP/nvidia_pytriton.libs:$LIBPYTHON" PATH="$(pwd)/.venv-triton/bin:$PATH" \\
    "$SP/pytriton/tritonserver/bin/tritonserver" --model-repository "$(pwd)/{repo}" \\
    --backend-directory "$(pwd)/triton-backends"
```

## Triton's OpenAI-compatible frontend

In the same container (Triton 24.11 or later ships the frontend in
`/opt/tritonserver/python/openai`); it starts Triton itself, in process:

```
pip install /opt/tritonserver/python/triton*.whl
pip install -r /opt/tritonserver/python/openai/requirements.txt
python3 /opt/tritonserver/python/openai/openai_frontend/main.py --model-repository /models \\
    --tokenizer /models/{name}/1/artifact --openai-port 9000
curl -N localhost:9000/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0, "stream": true}}'
```

`--tokenizer` points at the artifact, which holds the model's tokenizer files; the frontend
needs it for chat completions (it applies the chat template itself). What the frontend sends
as guided decoding (`guided_decoding_guide_type` json, json_schema or regex) is honored; other
guide types are refused with a message naming the type.
"""
