"""Run by tests/unit/test_chain_sdk.py inside a Python that has the Bittensor SDK (bittensor>=11).

Reads a JSON request on stdin and prints the SDK's answers as JSON, all computed by the SDK's own
code: its Rust SCALE codec (`bittensor_core.Runtime`) loaded with the same runtime metadata
(storage keys, encoded values, call bytes), its generated catalogs of the newer runtime it ships
for (storage items, call parameters, error names), and its weight quantisation.

Request: {"metadata": path, "storage": [[pallet, item, params, value]], "calls": [[pallet,
function, params]], "items": [[pallet, item]], "errors": [name], "weights": [[uids, weights]]}.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import bittensor
import bittensor_core
from bittensor._generated import calls, storage
from bittensor._generated.errors import ERRORS
from bittensor.error_map import CUSTOM_TRANSACTION_ERRORS, DISPATCH_ERRORS
from bittensor.intents.weights import normalize


def _runtime(path: str) -> Any:
    raw = bytes.fromhex(Path(path).read_text().strip().removeprefix("0x"))
    probe = bittensor_core.Runtime(raw, 0, 1)
    version = probe.constant("System", "Version")
    return bittensor_core.Runtime(raw, version["spec_version"], version["transaction_version"])


def _call_params(pallet: str, function: str) -> list[str] | None:
    builder = getattr(getattr(calls, pallet, None), function, None)
    return None if builder is None else list(inspect.signature(builder).parameters)


def _value_type(pallet: str, item: str) -> str | None:
    descriptor = getattr(getattr(storage, pallet, None), item, None)
    return None if descriptor is None else descriptor.value_type_ident


def main() -> None:
    request = json.load(sys.stdin)
    runtime = _runtime(request["metadata"])
    state = {}
    for pallet, item, params, value in request["storage"]:
        key = runtime.storage_key(pallet, item, params)
        value_type = runtime.storage_entry(pallet, item).value_type
        state["0x" + key.hex()] = "0x" + runtime.encode(value_type, value).hex()
    names = {info.name for info in ERRORS.values()} | set(DISPATCH_ERRORS)
    answer = {
        "sdk_version": bittensor.__version__,
        "spec_version": runtime.spec_version,
        "state": state,
        "calls": ["0x" + runtime.compose_call(*call).hex() for call in request["calls"]],
        "newest_value_types": [_value_type(p, i) for p, i in request["items"]],
        "newest_call_params": [_call_params(p, f) for p, f, _ in request["calls"]],
        "known_errors": sorted(n for n in request["errors"] if n in names),
        "custom_codes": {str(k): v for k, v in CUSTOM_TRANSACTION_ERRORS.items()},
        "normalized": [normalize(uids, weights) for uids, weights in request["weights"]],
    }
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
