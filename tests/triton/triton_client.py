"""Run with the Triton environment's Python (.venv-triton), not by pytest: what the tests need
from Triton's own client packages, which that environment holds and the main one does not.

    python triton_client.py stream HOST:PORT MODEL < requests.json   gRPC ModelStreamInfer
    python triton_client.py config CONFIG_PBTXT                      parse with Triton's proto

`stream` reads a JSON list of requests, each `{"name": [datatype, nested values]}`, sends them
one after the other on one gRPC stream and prints, for each, its responses (text, counts,
final flag) or its error, as JSON.
"""

from __future__ import annotations

import json
import queue
import sys
from typing import Any

import numpy as np

TIMEOUT_S = 60.0
_NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}


def _array(datatype: str, values: Any) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([[v.encode() for v in row] for row in values], dtype=np.object_)
    return np.array(values, dtype=_NUMPY[datatype])


def _optional(result: Any, name: str) -> Any:
    array = result.as_numpy(name)
    return None if array is None else array.reshape(-1)[0].item()


def stream(url: str, model: str, requests: list[dict[str, list[Any]]]) -> list[dict[str, Any]]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    results = []
    try:
        for number, request in enumerate(requests):
            inputs = []
            for name, (datatype, values) in request.items():
                array = _array(datatype, values)
                tensor = grpcclient.InferInput(name, list(array.shape), datatype)
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            client.async_stream_infer(model, inputs, request_id=str(number), enable_empty_final_response=True)
            responses: list[dict[str, Any]] = []
            error = None
            while True:
                result, failure = events.get(timeout=TIMEOUT_S)
                if failure is not None:
                    error = str(failure)
                    break
                final = result.get_response().parameters["triton_final_response"].bool_param
                text = result.as_numpy("text_output")
                responses.append(
                    {
                        "text": None if text is None else text.reshape(-1)[0].decode(),
                        "num_input_tokens": _optional(result, "num_input_tokens"),
                        "num_output_tokens": _optional(result, "num_output_tokens"),
                        "final": final,
                    }
                )
                if final:
                    break
            results.append({"responses": responses, "error": error})
    finally:
        client.stop_stream()
        client.close()
    return results


def config(path: str) -> dict[str, Any]:
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    with open(path) as f:
        parsed = text_format.Parse(f.read(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(parsed, preserving_proto_field_name=True)


def main() -> None:
    if sys.argv[1] == "stream":
        print(json.dumps(stream(sys.argv[2], sys.argv[3], json.load(sys.stdin))))
    elif sys.argv[1] == "config":
        print(json.dumps(config(sys.argv[2])))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}; use stream or config")


if __name__ == "__main__":
    main()
